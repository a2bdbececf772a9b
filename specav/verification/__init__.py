"""Verification: sampling transforms, lossless rejection sampling, the planners and the cost model.

    sampling.py       logits -> processed distributions, categorical draws (explicit generators)
    sampling_rows.py  each request's sampling parameters expanded to its rows
    rejection.py      accept / recover / bonus over a ragged batch, and its plain reference
    planner.py        the Planner protocol, its registry and the static planner
    adaptive.py       adaptive verification: survival-ranked drafting and admission under a price
    cost_model.py     profiled stage costs, corrected online

Pure functions over tensors and explicit `torch.Generator`s; nothing here imports models,
the engine or the server.
"""

from specav.verification import adaptive as _adaptive  # noqa: F401  (registers the "adaptive" planner)
