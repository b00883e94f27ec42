"""Other replay buffers' APIs over replaybuf, so code written for them runs unchanged."""
