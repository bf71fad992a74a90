"""The CUDA driver against the driver contract: on the CPU over paged_reference (flashinfer's
wrappers as torch loops), which checks its planning, groups and graph padding; on a GPU over
flashinfer itself with CUDA graphs captured, in bfloat16 against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import tests.paged_reference as paged_reference
from pie.drivers.batch import ForwardBatch
from pie.drivers.cuda_driver import CudaDriver
from pie.drivers.cuda_graphs import DecodeGraph
from pie.drivers.loader import LoadedModel, load_model
from pie.drivers.select import load_flashinfer
from pie.drivers.torch_driver import TorchDriver
from pie.events.sampling import Argmax
from tests.contracts.driver import DriverContract
from tests.contracts.driver_chaining import ChainingContract
from tests.contracts.passes import (
    NewDriver,
    PageSupply,
    Reference,
    assert_close,
    logits_of,
    prompt,
    request,
    run,
    token_of,
)
from tests.tiny_models import TINY_TOLERANCE, save_tiny_model
from tests.tiny_models import reference_logits as transformers_logits

pytestmark = pytest.mark.integration

PAGE = 4
LIMITS = dict(page_size=PAGE, num_pages=64, max_batch_tokens=24, max_batch_requests=6)
GPU_CASES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", hidden_size=256),
    "qwen2": dict(model_type="qwen2", hidden_size=256),
    "qwen3": dict(model_type="qwen3", hidden_size=256, head_dim=128),
}
"""Tiny random models with the head sizes flashinfer's kernels are built for (64 and 128)."""


def _flashinfer_or_skip() -> Any:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA driver's GPU tests need one")
    module, why = load_flashinfer()
    if module is None:
        pytest.skip(why)
    return module


class _CudaDriverRunner(DriverContract, ChainingContract):
    device: ClassVar[str]
    dtype: ClassVar[torch.dtype]
    case: ClassVar[dict[str, Any]]

    capture: ClassVar[bool]

    @classmethod
    def kernels(cls) -> Any:
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def tiny(cls, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
        folder = tmp_path_factory.mktemp("tiny")
        return folder, save_tiny_model(folder, cls.case)

    @pytest.fixture(scope="class")
    @classmethod
    def loaded(cls, paged_kernels: Any, tiny: tuple[Path, torch.nn.Module]) -> LoadedModel:
        return load_model(str(tiny[0]), cls.dtype, cls.device)

    @pytest.fixture(scope="class")
    @classmethod
    def paged_kernels(cls) -> Any:
        return cls.kernels()

    @pytest.fixture
    def new_driver(self, paged_kernels: Any, loaded: LoadedModel) -> NewDriver:
        kernels = paged_kernels

        def build() -> CudaDriver:
            return CudaDriver(
                loaded.model,
                loaded.config,
                kernels=kernels,
                device=self.device,
                dtype=self.dtype,
                model_name="tiny",
                graph_batch_sizes=(1, 2, 4),
                capture=self.capture,
                seed=0,
                **LIMITS,
            )

        return build

    @pytest.fixture
    def reference_logits(self, tiny: tuple[Path, torch.nn.Module]) -> Reference:
        return lambda tokens: transformers_logits(tiny[1], torch.tensor(tokens))

    def test_decode_passes_run_through_the_graph_buckets(self, new_driver: NewDriver) -> None:
        driver = new_driver()
        assert isinstance(driver, CudaDriver) and driver.graphs is not None
        replayed: list[int] = []
        original = DecodeGraph.replay

        def counting(graph: DecodeGraph) -> torch.Tensor:
            replayed.append(graph.size)
            return original(graph)

        supply = PageSupply(driver.info, seed=30)
        contexts = [(prompt(driver.info, 5, seed=30 + i), supply.for_tokens(7)) for i in range(3)]
        run(driver, *(request(0, tokens, pages, ()) for tokens, pages in contexts))
        DecodeGraph.replay = counting  # type: ignore[method-assign]
        try:
            run(driver, *(request(5, [1], pages) for _, pages in contexts))
            run(driver, request(6, [2], contexts[0][1]))
        finally:
            DecodeGraph.replay = original  # type: ignore[method-assign]
        assert replayed == [4, 1]


class TestCudaDriverOnReferenceKernels(_CudaDriverRunner):
    """float32 on the CPU: graphs are run eagerly over their static buffers."""

    computes_model = True
    reference_tolerance = TINY_TOLERANCE
    logit_tolerance = 1e-5
    device = "cpu"
    dtype = torch.float32
    capture = False
    case = dict(model_type="qwen3", head_dim=32)

    @classmethod
    def kernels(cls) -> Any:
        return paged_reference


class TestCudaDriverOnFlashinfer(_CudaDriverRunner):
    """bfloat16 on a GPU with graphs captured; tokens may differ between batch shapes, where
    bfloat16 rounding differs (the logits agree within logit_tolerance)."""

    computes_model = True
    reference_tolerance = 0.25
    """Twice the largest gap seen between a bfloat16 run and transformers in float32 (0.13)."""
    logit_tolerance = 0.06
    """Twice the largest gap seen in bfloat16 between one position computed in passes of
    different shapes (0.032)."""
    mask_effect = 0.5
    batch_invariant_tokens = False
    device = "cuda"
    dtype = torch.bfloat16
    capture = True
    case = GPU_CASES["qwen3"]

    @classmethod
    def kernels(cls) -> Any:
        return _flashinfer_or_skip()


# -- on a GPU only: against the torch driver, and graphs against eager passes ------------------


@pytest.fixture(scope="module")
def flashinfer_kernels() -> Any:
    return _flashinfer_or_skip()


@pytest.fixture(scope="module", params=list(GPU_CASES))
def gpu_model(
    request: pytest.FixtureRequest,
    flashinfer_kernels: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_model(folder, GPU_CASES[request.param])
    return request.param, folder


def _driver(kernels: Any, folder: Path, dtype: torch.dtype, graphs: tuple[int, ...] | None) -> Any:
    loaded = load_model(str(folder), dtype, "cuda")
    limits = dict(LIMITS, num_pages=256, max_batch_tokens=128, max_batch_requests=16)
    if kernels is None:
        return TorchDriver(
            loaded.model,
            loaded.config,
            device="cuda",
            dtype=dtype,
            model_name="t",
            seed=0,
            **limits,
        )
    return CudaDriver(
        loaded.model,
        loaded.config,
        kernels=kernels,
        device="cuda",
        dtype=dtype,
        model_name="t",
        graph_batch_sizes=graphs,
        seed=0,
        **limits,
    )


def _greedy(driver: Any, tokens: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation of `tokens` one pass per token, and the logits of every step."""
    pages = PageSupply(driver.info, seed=3).for_tokens(len(tokens) + steps)
    [out] = run(driver, request(0, tokens, pages))
    made: list[int] = []
    logits = [logits_of(out)]
    for _ in range(steps):
        made.append(int(logits[-1].argmax()))
        [out] = run(driver, request(len(tokens) + len(made) - 1, made[-1:], pages))
        logits.append(logits_of(out))
    return made, logits


def test_logits_match_the_torch_driver_in_bfloat16(
    flashinfer_kernels: Any, gpu_model: tuple[str, Path]
) -> None:
    name, folder = gpu_model
    cuda = _driver(flashinfer_kernels, folder, torch.bfloat16, ())
    plain = _driver(None, folder, torch.bfloat16, None)
    tokens = prompt(cuda.info, 23, seed=5)
    _, got = _greedy(cuda, tokens, 8)
    pages = PageSupply(plain.info, seed=3).for_tokens(len(tokens) + 8)
    [out] = run(plain, request(0, tokens, pages))
    worst = (logits_of(out) - got[0]).abs().max().item()
    print(f"{name}: bfloat16 CUDA driver vs torch driver, max logit gap {worst:.4f}")
    assert worst <= 0.15


def test_greedy_tokens_follow_the_float32_torch_driver(
    flashinfer_kernels: Any, gpu_model: tuple[str, Path]
) -> None:
    """64 greedy tokens equal the float32 torch driver's, up to the first step where float32's
    two best logits are closer than bfloat16 can tell apart (after which they may part)."""
    name, folder = gpu_model
    cuda = _driver(flashinfer_kernels, folder, torch.bfloat16, ())
    exact = _driver(None, folder, torch.float32, None)
    tokens = prompt(cuda.info, 11, seed=6)
    got, _ = _greedy(cuda, tokens, 64)
    want, want_logits = _greedy(exact, tokens, 64)
    parted = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    print(f"{name}: greedy tokens agree for {64 if parted is None else parted} of 64")
    if parted is not None:
        top2 = want_logits[parted].topk(2).values
        assert (top2[0] - top2[1]).item() < 2 * TestCudaDriverOnFlashinfer.reference_tolerance


@pytest.mark.parametrize("graphs", [(1, 2, 4, 8, 16)])
def test_every_graph_bucket_replays_the_eager_pass(
    flashinfer_kernels: Any, gpu_model: tuple[str, Path], graphs: tuple[int, ...]
) -> None:
    _, folder = gpu_model
    graphed = _driver(flashinfer_kernels, folder, torch.bfloat16, graphs)
    eager = _driver(flashinfer_kernels, folder, torch.bfloat16, None)
    for size in sorted({*graphs, *(g - 1 for g in graphs if g > 1)}):
        supply = PageSupply(graphed.info, seed=size)
        contexts = [
            (
                tokens := prompt(graphed.info, 6 + i, seed=size * 50 + i),
                supply.for_tokens(len(tokens) + 1),
            )
            for i in range(size)
        ]
        warm = [request(0, tokens, pages, ()) for tokens, pages in contexts]
        step = [request(len(tokens), [7], pages) for tokens, pages in contexts]
        outputs = []
        for driver in (graphed, eager):
            for one in warm:
                run(driver, one)
            outputs.append(run(driver, *step))
        for got, want in zip(*outputs, strict=True):
            assert_close(
                logits_of(got), logits_of(want), TestCudaDriverOnFlashinfer.logit_tolerance
            )


@pytest.mark.parametrize("graphs", [True, False])
def test_launching_a_chained_pass_does_not_wait_for_the_device(
    flashinfer_kernels: Any, tmp_path: Path, graphs: bool
) -> None:
    """The host builds a pass while the device runs the one before: with the device held busy
    behind a launched decode pass, launching the pass chained on it returns before the device
    is done (a blocking copy or a stream sync anywhere in `launch` would wait for it)."""
    save_tiny_model(tmp_path, GPU_CASES["qwen3"])
    driver = _driver(flashinfer_kernels, tmp_path, torch.bfloat16, (1, 2, 4) if graphs else None)
    supply = PageSupply(driver.info, seed=9)
    contexts = [(prompt(driver.info, 6, seed=9 + i), supply.for_tokens(12)) for i in range(2)]
    first = [request(0, tokens, pages, (Argmax(),)) for tokens, pages in contexts]
    driver.collect(driver.launch(ForwardBatch.from_requests(first)))
    decodes = [request(6, [1], pages, (Argmax(),)) for _, pages in contexts]
    launched = driver.launch(ForwardBatch.from_requests(decodes))
    torch.cuda._sleep(2_000_000_000)  # about a second of the device's time, after that pass
    spun = torch.cuda.Event()
    spun.record()
    chained = ForwardBatch.from_requests(
        [request(7, [0], pages, (Argmax(),)) for _, pages in contexts]
    )
    chained.chained = [(0, 0), (1, 1)]
    following = driver.launch(chained, after=launched)
    assert not spun.query(), "launch waited for the device"
    tokens = [token_of(out) for out in driver.collect(launched)]
    assert len(driver.collect(following)) == 2 and len(tokens) == 2


def test_the_gpu_benchs_chained_steps_make_the_tokens_fed_steps_make(tmp_path: Path) -> None:
    """`pie bench gpu`'s chained decode (each step launched before the last is collected) on the
    reference kernels: the same greedy tokens as its steps fed from the host."""
    from pie.cli.bench.gpu import Workload

    save_tiny_model(tmp_path, dict(model_type="qwen3", head_dim=32))
    loaded = load_model(str(tmp_path), torch.float32, "cpu")
    made = []
    for chained in (False, True):
        driver = CudaDriver(
            loaded.model,
            loaded.config,
            kernels=paged_reference,
            device="cpu",
            dtype=torch.float32,
            model_name="t",
            graph_batch_sizes=(1, 2, 4),
            capture=False,
            seed=0,
            page_size=16,
            num_pages=64,
            max_batch_tokens=256,
            max_batch_requests=4,
        )
        work = Workload(driver, 3, 64)
        work.prefill(driver, 8, 256)
        if chained:
            steps = work.chained_steps(driver, 6)
        else:
            steps = [work.decode_step(driver) for _ in range(6)]
        assert len(steps) == 6
        made.append((work.last, work.lengths))
    assert made[0] == made[1]
