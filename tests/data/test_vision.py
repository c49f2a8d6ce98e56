"""Images in prompts: the processor's encoding, image columns from files and `datasets`, the errors a user
meets (a missing or unreadable image, a text-only model), and that the trainer scores a sampled VLM response
as the engine did (logprob parity with images)."""

import asyncio
import json

import pytest
import torch

from rollflow.config import load_config
from rollflow.data.prompts import EncodedPrompt, PromptEncoder, load_rows
from rollflow.data.sample import Sample, collate
from rollflow.data.vision import (
    IMAGE_PAD,
    VisionInputs,
    check_image_column,
    load_vision_processor,
    read_image,
    resolve_image_paths,
    vision_from_state,
    vision_state,
)
from rollflow.data.visual_tasks import count_shapes_splits, draw_cells
from rollflow.errors import DataError
from rollflow.inputs.conversations import load_supervised_inputs
from rollflow.inputs.prompt_sets import encode_prompts, load_prompt_sets
from rollflow.models import load_tokenizer
from rollflow.pipelines.rlvr import rlvr_roles

TOKENS_PER_IMAGE = 16  # a 32x32 image: 8x8 patches of 4 pixels, merged 2x2


@pytest.fixture(scope="module")
def encoder(vl_model_dir):
    tokenizer = load_tokenizer(vl_model_dir)
    return PromptEncoder(tokenizer, processor=load_vision_processor(vl_model_dir, tokenizer))


def _image(colour=(230, 40, 40), cells=(0, 5)):
    return draw_cells({cell: colour for cell in cells})


def test_the_processor_expands_each_image_to_its_tokens_and_keeps_the_pixels(encoder):
    images = [_image(), _image((40, 90, 235), (3,))]
    prompt = encoder.encode({"prompt": "Left <image> right <image> same?", "images": images})
    ids = prompt.token_ids
    pad = encoder.processor.image_token_id
    assert ids.count(pad) == 2 * TOKENS_PER_IMAGE
    assert prompt.vision.image_grid_thw.tolist() == [[1, 8, 8], [1, 8, 8]]
    assert prompt.vision.pixel_values.shape == (2 * 64, 3 * 2 * 4 * 4)  # patches x (channels, time, 4x4 pixels)
    text = encoder.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == prompt.text.replace(IMAGE_PAD, IMAGE_PAD * TOKENS_PER_IMAGE)  # the rendered prompt, expanded
    assert text.index("Left") < text.index(IMAGE_PAD) < text.index("right")  # where the markers put them
    # one image's pixels are the image's: the same image processed alone gives the same patches
    alone = encoder.processor.process([images[1]])
    assert torch.equal(prompt.vision.pixel_values[64:], alone.pixel_values)
    # a prompt without markers has its image before the text (Qwen2-VL's format); a text row has no vision
    plain = encoder.encode({"prompt": "How many red squares?", "images": [images[0]]})
    assert plain.text.index(IMAGE_PAD) < plain.text.index("How many")
    assert encoder.encode({"prompt": "no image"}).vision is None


def test_a_prompt_s_images_survive_its_checkpoint_state(encoder):
    prompt = encoder.encode({"prompt": "How many blue squares?", "images": [_image((40, 90, 235))]})
    state = json.loads(json.dumps(prompt.state()))  # what a checkpoint's pending prompts hold: JSON
    back = EncodedPrompt.from_state(state)
    assert back.token_ids == prompt.token_ids and back.text == prompt.text
    assert torch.equal(back.vision.pixel_values, prompt.vision.pixel_values)
    assert torch.equal(back.vision.image_grid_thw, prompt.vision.image_grid_thw)
    assert back.vision.images[0].tobytes() == prompt.vision.images[0].tobytes()
    again = vision_from_state(vision_state(back.vision))
    assert torch.equal(again.pixel_values, prompt.vision.pixel_values)


def test_jsonl_image_paths_are_read_relative_to_the_dataset_file(tmp_path, encoder):
    (tmp_path / "img").mkdir()
    _image(cells=(1, 2, 3)).save(tmp_path / "img" / "three.png")
    _image(cells=(7,)).save(tmp_path / "img" / "one.png")
    rows = [{"prompt": "How many red squares?", "images": "img/three.png", "answer": "3"},
            {"prompt": "How many red squares?", "images": ["img/one.png"], "answer": "1"}]
    path = tmp_path / "shapes.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = resolve_image_paths(load_rows(path=str(path)), "images", tmp_path)
    assert loaded[0]["images"] == str(tmp_path / "img" / "three.png")
    prompts = encode_prompts(encoder, loaded, "data.train", max_new_tokens=2)
    assert [p.vision.num_images for p in prompts] == [1, 1]
    direct = encoder.processor.process([read_image(tmp_path / "img" / "three.png")])
    assert torch.equal(prompts[0].vision.pixel_values, direct.pixel_values)
    assert not torch.equal(prompts[0].vision.pixel_values, prompts[1].vision.pixel_values)


def test_a_datasets_image_column_saved_to_disk_is_read(tmp_path, encoder):
    datasets = pytest.importorskip("datasets")
    images = [_image(cells=(0,)), _image(cells=(4, 9))]
    features = datasets.Features({"prompt": datasets.Value("string"), "images": datasets.List(datasets.Image()),
                                  "answer": datasets.Value("string")})
    dataset = datasets.Dataset.from_dict({"prompt": ["How many red squares?"] * 2, "images": [[i] for i in images],
                                          "answer": ["1", "2"]}, features=features)
    dataset.save_to_disk(str(tmp_path / "shapes"))
    rows = load_rows(path=str(tmp_path / "shapes"))
    prompts = encode_prompts(encoder, rows, "data.train", max_new_tokens=2)
    for prompt, image in zip(prompts, images):
        assert torch.equal(prompt.vision.pixel_values, encoder.processor.process([image]).pixel_values)


def test_a_missing_or_unreadable_image_is_one_line_naming_the_row(tmp_path, encoder):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    good = {"prompt": "How many red squares?", "images": [_image()]}
    for value, expected in ((str(tmp_path / "gone.png"), "image file .*gone.png' does not exist"),
                            (str(tmp_path / "broken.png"), "broken.png' is not an image file PIL can read"),
                            (12, "an image must be a file path, a PIL image or image bytes, got int")):
        with pytest.raises(DataError, match=expected) as caught:
            encode_prompts(encoder, [good, {"prompt": "How many?", "images": value}], "data.train", max_new_tokens=2)
        message = str(caught.value)
        assert message.startswith("data.train row 2: ") and "\n" not in message


def test_a_text_only_model_given_image_rows_says_so_in_one_line(tmp_path):
    from rollflow.fresh_model import save_fresh_model

    save_fresh_model(tmp_path, seed=0)
    text_encoder = PromptEncoder(load_tokenizer(str(tmp_path)))
    rows = [{"prompt": "What is 1+1?"}, {"prompt": "How many red squares?", "images": [_image()]}]
    with pytest.raises(DataError) as caught:
        encode_prompts(text_encoder, rows, "data.eval", max_new_tokens=2)
    message = str(caught.value)
    assert message.startswith("data.eval row 2: the row has images (column 'images'), but the model is text-only")
    assert "\n" not in message


def _shapes_file(tmp_path, column: str = "images") -> str:
    """Two rows of a JSONL dataset whose images (a file each) are in `column`."""
    _image(cells=(1, 2)).save(tmp_path / "two.png")
    rows = [{"prompt": "How many red squares?", column: "two.png", "answer": "2"},
            {"prompt": "How many red squares?", column: ["two.png"], "answer": "2"}]
    (tmp_path / "shapes.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(tmp_path / "shapes.jsonl")


def _vlm_inputs(*overrides: str):
    config = load_config(None, ["model.path=tiny-vl", "data.eval=null", *overrides])
    return load_prompt_sets(config, rlvr_roles(config))


def test_an_image_key_that_no_row_has_is_one_line_naming_the_columns(tmp_path):
    """A misspelt `data.image_key` would train the VLM on text only: refused before anything is encoded."""
    data = _shapes_file(tmp_path)
    with pytest.raises(DataError) as caught:
        _vlm_inputs(f"data.train={{path: {data}}}", "data.image_key=image")
    assert str(caught.value) == (f"data.image_key is 'image', but no row of data.train ({data}) has that column "
                                 "(columns: answer, images, prompt); set it to the column holding the images")
    # the key that names the column encodes the images
    inputs = _vlm_inputs(f"data.train={{path: {data}}}")
    assert [p.vision.num_images for p in inputs.train_prompts] == [1, 1]
    assert not any("image" in warning for warning in inputs.warnings)


def test_a_vlm_given_rows_without_images_is_warned_that_it_gets_text_only(tmp_path):
    """The default key, the images in another column: the run goes on (a VLM may train on text) and says so."""
    data = _shapes_file(tmp_path, column="image")
    inputs = _vlm_inputs(f"data.train={{path: {data}}}")
    assert [p.vision for p in inputs.train_prompts] == [None, None]
    assert (f"no row of data.train ({data}) has images in column 'images' (data.image_key; columns: answer, "
            "image, prompt): the vision-language model gets text-only prompts; set data.image_key to the column "
            "holding the images") in inputs.warnings


def test_sft_gets_the_same_image_column_check(tmp_path):
    data = _shapes_file(tmp_path)
    rows = [{**json.loads(line), "response": "2"} for line in open(data)]
    (tmp_path / "shapes.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(None, ["pipeline=sft", "model.path=tiny-vl", f"data.train={{path: {data}}}", "data.eval=null",
                                "train.batch_size=2", "data.image_key=image"])
    with pytest.raises(DataError, match=r"^data.image_key is 'image', but no row of data.train \(.*shapes.jsonl\) "
                                        r"has that column \(columns: answer, images, prompt, response\)"):
        load_supervised_inputs(config, ["actor_train"])


def test_the_image_column_check_reads_every_dataset_of_the_run():
    with_images = ("data.train (shapes.jsonl)", [{"prompt": "?", "img": "a.png"}, {"prompt": "?"}])
    text_only = ("data.domains.math.train (task 'add2')", [{"prompt": "1+1="}])
    empty = ("data.eval (empty.jsonl)", [{"prompt": "?", "img": None}, {"prompt": "?", "img": []}])
    # a text-only dataset next to one with images, under a key that is not the default: nothing to say
    assert check_image_column([with_images, text_only], "img", "images", vision=True) == []
    # a text run keeps the default key without such a column
    assert check_image_column([text_only], "images", "images", vision=False) == []
    # a column that is there but empty everywhere: a warning for a VLM only, not an error
    assert len(check_image_column([empty], "img", "images", vision=True)) == 1
    assert check_image_column([empty], "img", "images", vision=False) == []
    # a key that names no column of any dataset: an error for a text model too
    with pytest.raises(DataError, match=r"^data.image_key is 'picture', but no row of data.domains.math.train "
                                        r"\(task 'add2'\) or data.eval \(empty.jsonl\) has that column "
                                        r"\(columns: img, prompt\); set it"):
        check_image_column([text_only, empty], "picture", "images", vision=False)


def test_a_prompt_whose_markers_disagree_with_its_images_is_refused(encoder):
    with pytest.raises(DataError, match="the prompt has 2 <image> markers for 1 images"):
        encoder.encode({"prompt": "<image> and <image>?", "images": [_image()]})


def test_a_model_without_an_image_processor_is_one_line(tmp_path, vl_model_dir):
    import shutil

    shutil.copytree(vl_model_dir, tmp_path / "m")
    (tmp_path / "m" / "preprocessor_config.json").unlink()
    with pytest.raises(DataError, match="has no image processor it can load"):
        load_vision_processor(str(tmp_path / "m"), load_tokenizer(vl_model_dir))


def test_the_trainer_scores_a_sampled_vlm_response_as_the_engine_did(vl_model_dir, encoder):
    """Rows with one image, two images and none, sampled n=2 by the hf engine (prefilled with the images,
    mrope positions, the KV cache shared by the group), then scored by the trainer's forward in one batch."""
    from rollflow.backends.logprobs import response_logprobs
    from rollflow.engines import create_engine
    from rollflow.engines.base import GenerationRequest, SamplingParams
    from rollflow.models import load_causal_lm

    train, _ = count_shapes_splits()
    rows = [train[0], {"prompt": "Same count? <image> <image>", "images": [train[1]["images"][0], _image()]},
            {"prompt": "How many red squares are there?"}]
    prompts = [encoder.encode(row) for row in rows]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=3)
    engine = create_engine("hf", model_path=vl_model_dir)
    try:
        async def generate():
            return await asyncio.gather(*(engine.generate(GenerationRequest(f"r{i}", p.token_ids, params, p.vision))
                                          for i, p in enumerate(prompts)))

        completions = asyncio.run(generate())
    finally:
        engine.close()
    samples = [Sample(prompt.token_ids, list(out.token_ids), list(out.logprobs), [1] * len(out.token_ids),
                      vision=prompt.vision)
               for prompt, completion in zip(prompts, completions) for out in completion.outputs]
    assert all(len(s.response_ids) > 0 for s in samples)
    batch = collate(samples, pad_token_id=encoder.tokenizer.pad_token_id)
    model = load_causal_lm(vl_model_dir)
    with torch.no_grad():
        trainer = response_logprobs(model, batch)
        # the images matter: the same tokens with another image score differently
        other = encoder.processor.process([_image((40, 90, 235), (9, 10, 11, 12))])
        blind = response_logprobs(model, collate([Sample(s.prompt_ids, s.response_ids, s.response_logprobs,
                                                         s.loss_mask, vision=other) for s in samples[:2]], 0))
    gap = ((trainer - batch.rollout_logprobs) * batch.response_mask).abs().max().item()
    assert gap < 1e-4, gap
    assert ((blind - trainer[:2, : blind.shape[1]]) * batch.response_mask[:2, : blind.shape[1]]).abs().max() > 1e-3
    # a micro-batch of the rows in another order gives the same (each row's images follow it)
    reordered = batch.select(torch.tensor([5, 2, 0]))
    with torch.no_grad():
        again = response_logprobs(model, reordered)
    assert ((again - trainer[[5, 2, 0]]) * reordered.response_mask).abs().max().item() < 1e-4


def test_vision_inputs_follow_their_rows_through_batch_selection(encoder):
    prompts = [encoder.encode({"prompt": "How many red squares?", "images": [_image(cells=cells)]})
               for cells in ((0,), (1, 2))] + [encoder.encode({"prompt": "plain"})]
    samples = [Sample(p.token_ids, [5, 6], [0.0, 0.0], [1, 1], vision=p.vision) for p in prompts]
    batch = collate(samples, pad_token_id=0)
    picked = batch.select(torch.tensor([1, 2]))
    assert isinstance(picked.vision[0], VisionInputs) and picked.vision[1] is None
    assert torch.equal(picked.vision[0].pixel_values, prompts[1].vision.pixel_values)
