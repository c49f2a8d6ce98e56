"""A run's inputs, loaded, encoded and checked before its first step: one call per kind of input.

`load_prompt_sets` (RLVR's prompt sets, `prompt_sets.py`) and `load_supervised_inputs` (SFT and distillation
conversations, DPO preference pairs: `conversations.py`). This layer sits above `data` (rows, encoders,
samples), `models` (tokenizers, model configs), `rewards` (the columns a reward reads) and `engines` (an
engine's context setting), and below `pipelines`, whose steps call it: `pipelines/` holds no dataset code.
"""
