"""A background model file that does not load."""

raise ImportError("this background model cannot be imported")
