"""gpuswarm: the root package. Holds the version and the `gpuswarm` command that assembles each package's CLI."""

__version__ = "0.1.0"
