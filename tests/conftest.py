"""Shared fixtures: one thread per test process, a tiny random model saved to disk, one Ray per session."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # 2 shared cores: more OpenMP threads than our share slows small ops ~100x


def save_random_model(path, seed: int = 0, hidden: int = 64, layers: int = 2,
                      num_labels: int | None = None) -> str:
    """A random Qwen2 model with the char tokenizer, saved in HF format under `path`: a causal LM, or with
    `num_labels` a sequence classifier (a reward model)."""
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from rollflow.data.char_tokenizer import build_ascii_tokenizer
    from rollflow.fresh_model import fresh_qwen2_config

    tokenizer = build_ascii_tokenizer()
    labels = {} if num_labels is None else {"num_labels": num_labels}
    config = fresh_qwen2_config(tokenizer, hidden_size=hidden, num_layers=layers,
                               intermediate_size=2 * hidden, max_positions=64, **labels)
    torch.manual_seed(seed)
    model_class = Qwen2ForCausalLM if num_labels is None else Qwen2ForSequenceClassification
    model_class(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def step_samples():
    """A step's samples: two groups, with a truncated sample and a failed one (no response)."""
    from rollflow.data.sample import Sample, SampleStatus

    return [
        Sample([1, 2], [3, 4], [-0.5, -0.25], group_id=0, reward=1.0, rewards={"math_answer": 1.0}),
        Sample([1, 2], [5], [-1.0], group_id=0, reward=0.0, rewards={"math_answer": 0.0},
               status=SampleStatus.TRUNCATED),
        Sample([1], [6, 7, 8], [-0.1, -0.2, -0.3], group_id=1, reward=0.5, rewards={"math_answer": 0.5}),
        Sample([1], [], group_id=1, status=SampleStatus.FAILED),
    ]


def policy_batch():
    """A collated batch of 8 short samples in 2 groups of 4, rewards 0 / 1, with GRPO-like advantages (reward -
    0.5 on every response token): what a trainer's policy-gradient step takes."""
    from rollflow.data.sample import Sample, collate

    samples = [Sample(prompt_ids=[3, 20 + i % 5, 5], response_ids=[30 + i, 31, 32 + i % 3][: 1 + i % 3],
                      group_id=i // 4, reward=float(i % 2)) for i in range(8)]
    batch = collate(samples, pad_token_id=0)
    batch.extras["advantages"] = (batch.rewards - 0.5).unsqueeze(1) * batch.response_mask  # [B, T]
    return batch


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    return save_random_model(tmp_path_factory.mktemp("random_model"))


@pytest.fixture(scope="session")
def contract_model_dir(tmp_path_factory) -> str:
    """A random Qwen2 (head dim 32, 256 positions, decisive logits) with the char tokenizer."""
    from transformers import Qwen2ForCausalLM

    from rollflow.data.char_tokenizer import build_ascii_tokenizer
    from rollflow.fresh_model import fresh_qwen2_config

    path = tmp_path_factory.mktemp("contract_model")
    tokenizer = build_ascii_tokenizer()
    # initializer_range 0.2 (not 0.02) spreads the logits, so greedy argmaxes are never near-ties that
    # bf16 GPU kernels could flip.
    config = fresh_qwen2_config(tokenizer, hidden_size=64, intermediate_size=128, num_layers=2,
                               num_heads=2, num_kv_heads=1, max_positions=256,
                               initializer_range=0.2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def vl_model_dir(tmp_path_factory) -> str:
    """The fresh (untrained) tiny Qwen2-VL with its processor, saved once per session; tests only read it."""
    from rollflow.fresh_model import save_fresh_vl_model

    path = tmp_path_factory.mktemp("tiny-vl")
    save_fresh_vl_model(path, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def ray_session():
    """Start Ray once per test session (4 s); tests that need actors take this fixture. The runs in it keep
    their workers for the next run of the same shape (`keep_workers`): a worker process's start (~7-10 s of
    imports) is paid once per shape, not once per run."""
    from rollflow.cluster.pool import keep_workers
    from rollflow.cluster.ray_session import start_ray, stop_ray

    start_ray(num_cpus=2)
    with keep_workers(max_idle=12) as pool:  # the session's runs have more shapes than a sweep's (~0.5 GiB each)
        yield
        report = os.environ.get("ROLLFLOW_POOL_REPORT")  # a file: how well the session's workers were reused
        if report:
            with open(report, "a") as file:
                file.write(f"{os.getpid()}: {pool.started} workers started, {pool.adopted} adopted, "
                           f"{pool.evicted} evicted, {len(pool.idle)} idle at the end\n")
                for key, count in pool.started_keys.most_common():
                    file.write(f"  {count} started: {key}\n")
    stop_ray()


@pytest.fixture
def workers_not_kept(ray_session, monkeypatch):
    """Within the test, runs kill their workers at the end as outside a test session (no `keep_workers`): for
    the tests of that end."""
    import rollflow.cluster.pool as pool

    monkeypatch.setattr(pool, "_pool", None)


@dataclass
class CliResult:
    """What `rollflow ...` did: like `subprocess.CompletedProcess` (returncode, stdout, stderr)."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(ray_session, capsys, monkeypatch) -> Callable[..., CliResult]:
    """`cli("train", "examples/quickstart.yaml", "train.steps=2", env={...})`: the command line's `main`, in this
    process, in the session's Ray and with its kept workers (tests/README.md): what a `rollflow` subprocess does
    past its start-up (~4 s of imports and its own Ray: tests/cluster and tests/test_cli_prestart.py test
    those), with its exit code and its console output. `env` sets environment variables for the call."""
    from rollflow.cli import main

    def run(*argv: object, env: dict[str, str] | None = None) -> CliResult:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()  # what came before is not this command's
        try:
            code = main([str(item) for item in argv])
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code if isinstance(exit_.code, int) else 1
        out, err = capsys.readouterr()
        for name in env or {}:
            monkeypatch.delenv(name, raising=False)
        return CliResult(code, out, err)

    return run


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted on `mount_point` with `options` (e.g. "size=64k,ro") for the block; the test is skipped
    where mounting is not allowed (it needs root and mount rights)."""
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({options}) here (needs root and mount rights)")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)  # a file may still be open


# --- the tiers' budget (tests/README.md) ---------------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption(
        "--unmarked-slow-limit", type=float, default=None, metavar="SECONDS",
        help="fail the session if a test not marked `slow` took longer than SECONDS (setup, call and teardown "
             "together): the `not slow` tier stays fast. .ci/run sets 20; left out, nothing is checked "
             "(a loaded machine is no reason for a local run to fail)")
    parser.addoption(
        "--cpu-report", default=None, metavar="PATH",
        help="write each test's wall seconds and the machine's busy CPU seconds meanwhile (every process: Ray's "
             "workers, subprocesses) to PATH, one JSON line per test, and print the files that used the most "
             "CPU; run it serially on a quiet machine: it is the whole machine's CPU")


_unmarked_seconds: dict[str, float] = {}


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat: every state but idle and iowait)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--cpu-report")
    if path is None:
        yield
        return
    wall, busy = time.perf_counter(), _busy_cpu_seconds()
    yield
    with open(path, "a") as report:
        report.write(json.dumps({"test": item.nodeid, "wall_s": round(time.perf_counter() - wall, 2),
                                 "cpu_s": round(_busy_cpu_seconds() - busy, 2)}) + "\n")


def pytest_terminal_summary(terminalreporter, config):
    path = config.getoption("--cpu-report")
    if path is None or not os.path.exists(path):
        return
    per_file: dict[str, list[float]] = {}
    for line in open(path):
        row = json.loads(line)
        wall_cpu = per_file.setdefault(row["test"].split("::")[0], [0.0, 0.0])
        wall_cpu[0] += row["wall_s"]
        wall_cpu[1] += row["cpu_s"]
    terminalreporter.write_sep("=", f"busy CPU seconds by file (all of them in {path})")
    for file, (wall, cpu) in sorted(per_file.items(), key=lambda entry: -entry[1][1])[:30]:
        terminalreporter.write_line(f"{cpu:8.1f} cpu s {wall:8.1f} wall s  {file}")


# Under pytest-xdist (`-n 2 --dist loadgroup`, .ci/run) a group's tests run in one worker process, so the fixtures
# they share start once: each module is a group (its module fixtures), and these modules share one group for a
# session fixture costlier than a module's share of the run.
SHARED_GROUPS = {  # module -> group
    "tests/engines/test_engine_contract.py": "vllm-engine",  # vllm_cpu_engine (tests/engines/conftest.py): vLLM
    "tests/engines/test_vllm_engine.py": "vllm-engine",  # starts in ~25 s
    # Runs whose workers have the same shapes (rollflow.cluster.pool): in one process they adopt each other's
    # kept workers; split over the two, each process starts its own (~7 CPU-s a worker). Which shapes each
    # module started: ROLLFLOW_POOL_REPORT (the `ray_session` fixture).
    "tests/e2e/test_distributed_runs.py": "trainer-roles",  # critic, reference, actor_train, fsdp2 ranks
    "tests/e2e/test_algorithms_e2e.py": "trainer-roles",
    "tests/e2e/test_supervised_runs.py": "trainer-roles",
    "tests/e2e/test_agentic_runs.py": "env-roles",  # env workers
    "tests/e2e/test_env_service_drill.py": "env-roles",
    "tests/e2e/test_model_rewards.py": "reward-roles",  # reward workers
    "tests/workers/test_reward_worker.py": "reward-roles",
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    # The longest groups first (the workers take the next group when done): those with vLLM's runs, then those
    # with slow tests, then the rest, each in collection order; the last group to finish is then a short one.
    group_of: dict[str, str] = {}  # test -> its group
    rank: dict[str, int] = {}  # group -> 0, 1 or 2
    for item in items:
        if item.get_closest_marker("vllm") is not None:  # vLLM starts in ~25 s on CPU: the full tier's
            item.add_marker(pytest.mark.slow)
        module = item.nodeid.split("::")[0]
        group = group_of[item.nodeid] = SHARED_GROUPS.get(module, module)
        item.add_marker(pytest.mark.xdist_group(group))
        item_rank = 0 if item.get_closest_marker("vllm") else 1 if item.get_closest_marker("slow") else 2
        rank[group] = min(rank.get(group, 2), item_rank)
    items.sort(key=lambda item: rank[group_of[item.nodeid]])


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order above (its own puts the groups
        config.option.loadscopereorder = False  # with the most tests first, which are the quick ones)


def pytest_runtest_logreport(report):
    # setup, call and teardown of each test; under pytest-xdist the workers' reports reach the controller here
    if "slow" not in report.keywords:
        _unmarked_seconds[report.nodeid] = _unmarked_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    limit = session.config.getoption("--unmarked-slow-limit")
    if limit is None or hasattr(session.config, "workerinput"):  # an xdist worker: the controller checks
        return
    over = sorted(((s, nodeid) for nodeid, s in _unmarked_seconds.items() if s > limit), reverse=True)
    if over:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"{len(over)} test(s) not marked slow took over {limit:g} s (mark them @pytest.mark.slow, or "
                 "make them faster: tests/README.md):", *(f"  {s:6.1f} s  {nodeid}" for s, nodeid in over)]
        if reporter is not None:
            reporter.write_line("")
            for line in lines:
                reporter.write_line(line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
