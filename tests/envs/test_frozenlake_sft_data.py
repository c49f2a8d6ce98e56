"""`examples/agentic/make_frozenlake_sft.py --observation image`: the same mistaken-expert steps as the text
data, with the board as a PNG that the row names, and the VL agentic config's system prompt."""

import json
import subprocess
import sys
from pathlib import Path

import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "agentic" / "make_frozenlake_sft.py"


def _make(out: Path, *flags: str) -> dict[str, list[dict]]:
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--maps", "6", "--eval-maps", "2", *flags],
                   check=True, capture_output=True, text=True, timeout=120)
    return {split: [json.loads(line) for line in (out / f"{split}.jsonl").read_text().splitlines()]
            for split in ("train", "eval")}


def test_image_rows_are_the_text_rows_steps_with_their_boards(tmp_path):
    text = _make(tmp_path / "text")
    image = _make(tmp_path / "image", "--observation", "image")
    system = yaml.safe_load((ROOT / "examples" / "agentic_frozenlake_vl.yaml").read_text())
    for split in ("train", "eval"):
        assert len(image[split]) == len(text[split]) > 0
        # The same episodes in the same (shuffled) order: each step's action is the text data's.
        assert [row["messages"][-1] for row in image[split]] == [row["messages"][-1] for row in text[split]]
        for row in image[split]:
            roles = [message["role"] for message in row["messages"]]
            assert roles == ["system", "user", "assistant"]
            assert row["messages"][1]["content"] == "<image>"
            (name,) = row["images"]
            with Image.open(tmp_path / "image" / name) as board:
                assert board.size[0] > 0 and board.mode in ("RGB", "RGBA", "P")
    # The SFT prompt is the agentic step prompt: the config's system prompt, word for word.
    assert {row["messages"][0]["content"] for row in image["train"]} == {system["env"]["system_prompt"]}
    # Each board draws its state: the same text grid gives the same pixels, different grids different ones.
    pixels = {}
    for split in ("train", "eval"):
        for text_row, image_row in zip(text[split], image[split]):
            with Image.open(tmp_path / "image" / image_row["images"][0]) as board:
                pixels.setdefault(text_row["messages"][0]["content"], set()).add(board.convert("RGB").tobytes())
    assert all(len(drawn) == 1 for drawn in pixels.values())
    assert len({next(iter(drawn)) for drawn in pixels.values()}) == len(pixels) > 1
