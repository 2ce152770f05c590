"""Model weights: Hugging Face Hub access, the resumable download, the model store's layout, `.bin` to
safetensors conversion, the HF token, and the size estimate that picks resources.

Core: imports only `tgi_hpc.errors` from the rest of the toolkit.
"""
