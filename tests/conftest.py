"""Test-wide settings.

Unit tests run tiny models whose ops take microseconds; with a multi-threaded pool, each op
can wait milliseconds for a descheduled worker when the machine is busy. One intra-op thread
keeps them fast and stable. End-to-end tests on the real pair raise it themselves.
"""

import torch

torch.set_num_threads(1)
