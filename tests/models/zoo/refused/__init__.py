"""Models that deeppool must refuse up front, with one line naming the module."""
