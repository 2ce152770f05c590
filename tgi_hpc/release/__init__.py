"""Engine releases: the offline virtual environment `tgi-hpc compile` builds once and serve jobs activate.

`build` drives a build (target, lock, resume, `current`); `spec` says what to build, `builder` runs the
steps, `manifest` is release.json, `kernels` the optional flash-attn build, `verify`/`repair` check and fix
a copied release, and `selftest` runs inside the release's own python.
Core: imports only `tgi_hpc.errors` from the rest of the toolkit.
"""
