"""tinylm: a small GPT-style byte-level language model, trained on a directory of text files (the job file uses
the Python standard library's own sources).

`tinylm.model` is the plain PyTorch model (no gpuswarm needed to load a trained one); `tinylm.workload` is the
gpuswarm workload, the job's entrypoint `tinylm.workload:TinyLM`.
"""
