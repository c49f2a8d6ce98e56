"""Seeds derived from the run's `seed`: one stable hash per purpose, never arithmetic on the seed.

`seed * 1000 + worker` overflows `torch.Generator.manual_seed` for a large seed and collides for small ones
(seed 0, worker 1000 = seed 1, worker 0). `derive_seed(seed, "engine", worker)` hashes the parts instead:
the same parts give the same seed on every machine and Python version (no `hash()` randomization), and
different parts give unrelated seeds.
"""

from __future__ import annotations

import hashlib

SEED_BITS = 63  # a derived seed fits a signed 64-bit integer: torch, numpy's Generator and C libraries take it


def derive_seed(seed: int, *keys: int | str, bits: int = SEED_BITS) -> int:
    """A stable seed for one purpose of a run: blake2b of the run seed and the keys that name the purpose.

    Args:
        seed: the run's `seed` (any int; the config holds it in [0, 2**64)).
        *keys: what the seed is for, e.g. `"engine", worker_index` or `"actor_minibatches", version`. Ints
            and strings are encoded distinctly, so `1` and `"1"` give different seeds.
        bits: width of the result; 32 for libraries that seed numpy's legacy global generator
            (`numpy.random.seed` takes only [0, 2**32)), as vLLM and SGLang do with their engine seed.

    Returns:
        An int in [0, 2**bits), the same for the same arguments on every machine and run.

    Raises:
        TypeError: a part that is not an int or a str (a bool or float is refused: it would be ambiguous).
        ValueError: `bits` outside 1..64.
    """
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in 1..64, got {bits}")
    digest = hashlib.blake2b(digest_size=8, person=b"rollflow-seed")
    for part in (seed, *keys):
        if isinstance(part, bool) or not isinstance(part, (int, str)):
            raise TypeError(f"derive_seed takes ints and strings, got {type(part).__name__} {part!r}")
        encoded = (b"i" + str(part).encode()) if isinstance(part, int) else (b"s" + part.encode("utf-8"))
        digest.update(len(encoded).to_bytes(8, "big") + encoded)  # length-prefixed: parts cannot run together
    return int.from_bytes(digest.digest(), "big") >> (64 - bits)
