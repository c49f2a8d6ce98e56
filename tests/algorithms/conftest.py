"""Algorithm tests are tiny tensor computations; one thread keeps them fast on a shared machine."""

import torch

torch.set_num_threads(1)
