"""Where commands run: a local subprocess or one SSH connection (paramiko), the `ssh-config` entries,
and the port-forwarding tunnel to a compute node.

Core: imports only `tgi_hpc.errors`, `tgi_hpc.files` and `tgi_hpc.quoting` from the rest of the toolkit.
"""
