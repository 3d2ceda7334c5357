"""deeppool: burst-parallel training and GPU multiplexing."""

__version__ = "0.1.0"
