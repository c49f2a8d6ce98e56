"""Agentic episodes with image observations (FrozenLake drawn as an image) for a vision-language policy: every
turn's images reach the engine with the prompt that holds their tokens, a trajectory carries all of them to
the trainer, and the trainer scores the model's tokens as the hf engine sampled them."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollflow.data.multiturn import TurnEncoder
from rollflow.data.sample import SampleStatus, collate
from rollflow.data.vision import IMAGE_PAD, load_vision_processor
from rollflow.engines.base import SamplingParams
from rollflow.envs.frozenlake import FrozenLake
from rollflow.errors import DataError
from rollflow.models import load_tokenizer
from rollflow.rollout.core import RolloutCore
from rollflow.rollout.env_groups import EnvGroups, EpisodeSettings, SeedSource
from rollflow.rollout.settings import CoreSettings
from tests.rollout.test_env_groups import CORRIDOR, Remote, ScriptedEngine, env_worker

TOKENS_PER_BOARD = 16  # a 4x4 board: 32x32 pixels, one image token per cell
IMAGE_ENV = {"id": "frozenlake", "kwargs": {"fixed_map": CORRIDOR, "max_turns": 4, "observation": "image"}}


@pytest.fixture(scope="module")
def encoder(vl_model_dir):
    tokenizer = load_tokenizer(vl_model_dir)
    return TurnEncoder(tokenizer, processor=load_vision_processor(vl_model_dir, tokenizer))


class RecordingEngine(ScriptedEngine):
    """A scripted engine that also records each request's images."""

    def __init__(self, action: str):
        super().__init__(action)
        self.visions = []

    async def generate(self, request):
        self.visions.append(request.vision)
        return await super().generate(request)


def _play(engine, encoder, env=IMAGE_ENV, samples="trajectory", history_turns=0):
    episodes = EpisodeSettings(group_size=2, max_turns=4, max_context_tokens=256, step_timeout_s=5.0,
                               samples=samples, history_turns=history_turns)
    program = EnvGroups([Remote(env_worker(env))], encoder, episodes, SamplingParams(6))
    core = RolloutCore([engine], program, SeedSource(0, 1_000_000), CoreSettings(groups_per_step=1, watchdog_s=60.0))
    try:
        return core.next_batch(1, 0)
    finally:
        core.close()


def test_each_turn_s_board_reaches_the_engine_and_the_trajectory_keeps_them_all(encoder):
    engine = RecordingEngine("Right")
    result = _play(Remote(engine), encoder)
    samples = [s for s in result.samples if s.status != SampleStatus.FAILED]
    assert len(samples) == 2 and all(s.metadata["turns"] == 4 for s in samples)
    pad = encoder.processor.image_token_id
    for prompt, vision in zip(engine.prompts, engine.visions):  # turn k's prompt holds k boards, and so does vision
        assert prompt.count(pad) == TOKENS_PER_BOARD * vision.num_images
    assert sorted(v.num_images for v in engine.visions) == [1, 1, 2, 2, 3, 3, 4, 4]
    # the boards are the env's, in order: the player walks right along the corridor's top row
    env = FrozenLake(fixed_map=CORRIDOR, max_turns=4, observation="image")
    _, info = env.reset(seed=0)
    boards = [info["images"][0]] + [env.step("Right")[4]["images"][0] for _ in range(3)]
    expected = encoder.processor.process(boards)
    for sample in samples:
        assert torch.equal(sample.vision.pixel_values, expected.pixel_values)
        full = sample.prompt_ids + sample.response_ids
        assert full.count(pad) == 4 * TOKENS_PER_BOARD
        # the image tokens come from the env's turns (loss mask 0), never from the model's
        assert all(mask == 0 for token, mask in zip(sample.response_ids, sample.loss_mask) if token == pad)
    text = encoder.tokenizer.decode(samples[0].prompt_ids, skip_special_tokens=False)
    assert text.count("<|vision_start|>") == 1 and IMAGE_PAD * TOKENS_PER_BOARD in text


def test_a_text_only_policy_given_image_observations_says_so(tmp_path):
    from rollflow.fresh_model import save_fresh_model

    save_fresh_model(tmp_path, seed=0)
    with pytest.raises(DataError, match="observation has 1 image.*but the model is text-only"):
        _play(Remote(ScriptedEngine("Right")), TurnEncoder(load_tokenizer(str(tmp_path))))


@pytest.mark.parametrize("history_turns, boards", [(0, [1, 1, 1, 1]), (1, [1, 2, 2, 2])])
def test_step_wise_samples_hold_the_boards_of_their_own_prompt(encoder, history_turns, boards):
    engine = RecordingEngine("Right")
    result = _play(Remote(engine), encoder, samples="step", history_turns=history_turns)
    samples = [s for s in result.samples if s.status != SampleStatus.FAILED]
    assert len(samples) == 8  # 2 episodes x 4 turns
    pad = encoder.processor.image_token_id
    env = FrozenLake(fixed_map=CORRIDOR, max_turns=4, observation="image")
    _, info = env.reset(seed=0)
    expected = [encoder.processor.process([board]).pixel_values
                for board in [info["images"][0]] + [env.step("Right")[4]["images"][0] for _ in range(3)]]
    for sample in samples:
        turn = sample.turn_spans[0].turn
        assert sample.vision.num_images == boards[turn]
        assert sample.prompt_ids.count(pad) == TOKENS_PER_BOARD * boards[turn]
        assert torch.equal(sample.vision.pixel_values[-64:], expected[turn])  # its own board last
        assert sample.prompt_ids in engine.prompts


def test_the_trainer_scores_an_image_trajectory_as_the_hf_engine_sampled_it(vl_model_dir, encoder):
    from rollflow.backends.logprobs import response_logprobs
    from rollflow.engines import create_engine
    from rollflow.models import load_causal_lm

    engine = create_engine("hf", model_path=vl_model_dir)
    try:
        result = _play(Remote(engine), encoder, env={**IMAGE_ENV, "kwargs": {"size": 4, "max_turns": 6,
                                                                                "observation": "image"}})
    finally:
        engine.close()
    samples = [s for s in result.samples if s.status != SampleStatus.FAILED]
    assert samples and all(s.vision.num_images == len(s.turn_spans) for s in samples)
    assert any(s.vision.num_images > 1 for s in samples)  # at least one multi-turn trajectory
    batch = collate(samples, pad_token_id=encoder.tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = response_logprobs(load_causal_lm(vl_model_dir), batch)
    mask = batch.response_mask > 0
    assert (trainer - batch.rollout_logprobs)[mask].abs().max().item() < 1e-4


@pytest.mark.parametrize("samples, turns", [("trajectory", 1), ("step", 4)])
def test_a_trajectory_ends_where_the_policy_wrote_the_image_pad_token(vl_model_dir, encoder, samples, turns):
    """A trajectory whose model turn holds `<|image_pad|>` cannot go on: the next prefill would read that
    token as an image's, and the hf engine refuses the prompt (one line, not the rope index's StopIteration).
    It ends there (truncated) and trains as played; step-wise prompts re-render the turns as text (special
    tokens dropped), so they go on."""
    from rollflow.engines import create_engine
    from rollflow.engines.base import GenerationRequest

    engine = RecordingEngine("Right")
    engine.action_ids = engine.action_ids[:-1] + [encoder.processor.image_token_id] + engine.action_ids[-1:]
    result = _play(Remote(engine), encoder, samples=samples)
    if samples == "trajectory":
        assert [(s.status, s.metadata["turns"]) for s in result.samples] == [(SampleStatus.TRUNCATED, 1)] * 2
    else:
        assert sorted(s.turn_spans[0].turn for s in result.samples) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(engine.prompts) == 2 * turns
    pad = encoder.processor.image_token_id
    assert all(prompt.count(pad) == TOKENS_PER_BOARD * vision.num_images
               for prompt, vision in zip(engine.prompts, engine.visions))
    # what the next turn would have sent: the first prompt, the model's turn, the next observation
    first, vision = engine.prompts[0], engine.visions[0]
    stray = first + engine.action_ids + encoder.encode("Go on.")
    hf = create_engine("hf", model_path=vl_model_dir)
    try:
        with pytest.raises(Exception, match="the images give 16 image features for 17 image tokens"):
            asyncio.run(hf.generate(GenerationRequest("stray", stray, SamplingParams(2), vision)))
    finally:
        hf.close()


def test_frozenlake_draws_its_board_and_refuses_an_unknown_observation_kind():
    from rollflow.errors import ConfigError

    env = FrozenLake(fixed_map=CORRIDOR, max_turns=4, observation="image")
    observation, info = env.reset(seed=0)
    assert observation == "<image>" and info["anchor"] == "P___\nOOO_\nOOO_\nOOOG"
    board = info["images"][0]
    assert board.size == (32, 32)
    assert board.getpixel((4, 4)) == (230, 40, 40) and board.getpixel((28, 28)) == (40, 190, 70)  # you, the goal
    assert board.getpixel((4, 12)) == (20, 30, 110) and board.getpixel((12, 4)) == (170, 210, 250)  # hole, ice
    moved = env.step("Right")[4]["images"][0]
    assert moved.getpixel((12, 4)) == (230, 40, 40) and moved.getpixel((4, 4)) == (170, 210, 250)
    with pytest.raises(ConfigError, match="observation must be one of text, image"):
        FrozenLake(observation="pixels")
