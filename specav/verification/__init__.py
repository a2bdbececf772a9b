"""Verification: sampling transforms, lossless rejection sampling, (later) the planner and cost model.

Pure functions over tensors and explicit `torch.Generator`s; nothing here imports models,
the engine or the server.
"""
