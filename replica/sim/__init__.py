"""The simulated engine (``--model sim``): the replica with a GPU cost model in place of
the forward pass. ``profile``: the step-time formula; ``profiles``: named, cited
profiles; ``backend``: the sleeping step runner; ``setup``: flags and construction."""
