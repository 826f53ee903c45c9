"""The ``neuronxcc.nki`` front-end (``nl``, ``nisa``, ``typing``, ``compiler``) over the core."""
