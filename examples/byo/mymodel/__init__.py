"""mymodel: a job owner's own package. `mymodel.model` and `mymodel.data` are plain PyTorch (what the owner
would write anyway); `mymodel.workload` is the only module that knows gpuswarm."""
