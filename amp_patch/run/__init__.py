"""A run of mixed precision: the running ``session`` (what ``initialize``
changed, until ``deinitialize``), the ``plan`` that builds, applies and rolls
back one ``initialize``, and the ``flight`` of forwards, backwards and steps
the session waits for before it changes."""
