"""Model weights: Hugging Face Hub access, the resumable download, the model store's layout, `.bin` to
safetensors conversion, the HF token, the size estimate that picks resources, and which quantized
formats the engine serves (the checkpoint's or `serve --quantize`'s, which that estimate follows).

Core: imports only `tgi_hpc.errors` from the rest of the toolkit.
"""
