"""The service's vocabulary at every boundary: the request and result types (types.py), their msgpack wire format
(wire.py), the input checks every boundary shares (checks.py) and what counts as an int or a number there
(values.py). Light: no torch, so a learner that only reads results imports this alone."""
