"""Ways in that are not ``initialize`` itself: the launcher (``amp-patch run``),
the command line, the ``apex`` alias and the demo."""
