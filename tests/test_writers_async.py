"""AsyncWriter and MultiWriter: order, errors, bounded queue, deferred fetch."""

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxctx
import eqxctx.writers._read as writers_read
from eqxctx.writers import (
    AbstractWriter,
    AsyncWriter,
    HostSummaries,
    JsonlWriter,
    MultiWriter,
    TensorBoardWriter,
)
from tb_events import scalars


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Recorder(AbstractWriter):
    """Records what it is asked to write; optionally fails or waits."""

    def __init__(self, *, fail_at: int | None = None, gate: Any = None):
        self.steps: list[int] = []
        self.values: list[dict[str, Any]] = []
        self.flushes = 0
        self.closed = False
        self.fail_at = fail_at
        self.gate = gate
        self.thread_names: set[str] = set()
        self.attempts = 0

    def write_host(self, host: HostSummaries) -> None:
        self.thread_names.add(threading.current_thread().name)
        self.attempts += 1
        if self.gate is not None:
            self.gate.wait()
        if host.step == self.fail_at:
            raise OSError(f"disk full at {host.step}")
        self.steps.append(host.step)
        self.values.append(dict(host.values))

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("defer_fetch", "background_fetch"), [(False, True), (False, False), (True, False)]
)
def test_async_writes_everything_in_order(
    tmp_path: Path, defer_fetch: bool, background_fetch: bool
) -> None:
    inner = MultiWriter(JsonlWriter(tmp_path / "s.jsonl"), TensorBoardWriter(tmp_path))
    with AsyncWriter(
        inner,
        max_pending=3,
        defer_fetch=defer_fetch,
        background_fetch=background_fetch,
    ) as w:
        moments = eqxctx.MomentsSummary(jnp.arange(4.0))
        for step in range(50):
            w.write(step, {"loss": jnp.float32(step), "m": moments})
    lines = read_jsonl(tmp_path / "s.jsonl")
    assert [line["step"] for line in lines] == list(range(50))
    assert [line["loss"] for line in lines] == [float(s) for s in range(50)]
    assert [line["m/mean"] for line in lines] == [1.5] * 50
    tb = scalars(str(tmp_path))
    assert {k: v for k, v in tb.items() if k[1] == "loss"} == {
        (s, "loss"): float(s) for s in range(50)
    }


def test_async_writes_on_a_background_thread_and_flushes() -> None:
    inner = Recorder()
    w = AsyncWriter(inner)
    w.write(0, {"x": 1.0})
    w.flush()
    assert inner.steps == [0]
    assert inner.flushes == 1
    assert inner.thread_names == {"eqxctx-AsyncWriter"}
    w.close()
    w.close()  # twice is fine
    assert inner.closed
    with pytest.raises(ValueError, match="closed"):
        w.write(1, {"x": 1.0})


def test_async_background_error_raises_on_the_next_call() -> None:
    inner = Recorder(fail_at=2)
    w = AsyncWriter(inner)
    for step in range(3):
        w.write(step, {"x": float(step)})
    while inner.attempts < 3:  # the thread tried step 2 and failed
        time.sleep(0.01)
    with pytest.raises(OSError, match="disk full at 2") as info:
        w.write(3, {"x": 3.0})
    assert "failed writing step 2 with Recorder" in "".join(info.value.__notes__)
    with pytest.raises(ValueError, match=r"failed at step 2.*close this writer"):
        w.write(200, {"x": 1.0})
    w.close()  # the error was raised already
    assert inner.steps == [0, 1]  # nothing after the failed step
    assert inner.closed


@pytest.mark.parametrize("where", ["flush", "close"])
def test_async_background_error_raises_on_flush_and_close(where: str) -> None:
    w = AsyncWriter(Recorder(fail_at=0))
    w.write(0, {"x": 1.0})
    with pytest.raises(OSError, match="disk full at 0"):
        getattr(w, where)()
    w.close()


def test_async_close_raises_the_background_error_when_the_writer_close_fails() -> None:
    class FailsToClose(Recorder):
        def close(self) -> None:
            super().close()
            raise OSError("close failed")

    inner = FailsToClose(fail_at=1)
    w = AsyncWriter(inner)
    for step in range(3):
        w.write(step, {"x": float(step)})
    # The background error lost steps 1 and 2: it is the one raised, the close
    # error noted on it.
    with pytest.raises(OSError, match="disk full at 1") as info:
        w.close()
    notes = "".join(info.value.__notes__)
    assert "failed writing step 1 with FailsToClose" in notes
    assert "OSError('close failed')" in notes
    assert inner.steps == [0]
    assert inner.closed
    w.close()  # closed: nothing more to raise

    # With no background error, the close error is raised as it is.
    w = AsyncWriter(FailsToClose())
    w.write(0, {"x": 0.0})
    with pytest.raises(OSError, match="close failed"):
        w.close()


def test_async_bounded_queue_blocks_instead_of_growing() -> None:
    gate = threading.Event()
    inner = Recorder(gate=gate)
    w = AsyncWriter(inner, max_pending=2)
    done: list[int] = []

    def loop() -> None:
        for step in range(6):
            w.write(step, {"x": float(step)})
            done.append(step)

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.5)
    # One step in the worker (waiting at the gate) and two queued: the 4th waits.
    assert done == [0, 1, 2]
    assert thread.is_alive()
    gate.set()
    thread.join(timeout=10)
    assert done == list(range(6))
    w.close()
    assert inner.steps == list(range(6))


def test_async_defer_fetch_fetches_one_step_late() -> None:
    fetched: list[float] = []

    def record(x: Any) -> Any:
        fetched.append(float(x))
        return x

    inner = Recorder()
    w = AsyncWriter(inner, defer_fetch=True, background_fetch=False)
    w.write(0, {"x": eqxctx.CallbackSummary(record, jnp.float32(0))})
    assert fetched == []  # step 0 waits for the next write
    w.write(1, {"x": eqxctx.CallbackSummary(record, jnp.float32(1))})
    assert fetched == [0.0]
    w.flush()  # fetches the deferred step
    assert fetched == [0.0, 1.0]
    assert inner.steps == [0, 1]
    w.write(2, {"x": 2.0})
    w.close()  # writes the deferred step
    assert inner.steps == [0, 1, 2]


def test_defer_fetch_starts_each_steps_copies_at_its_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []
    real_start = writers_read.start

    def recording(leaves: list[Any], *args: Any) -> Any:
        started.append(len(leaves))
        return real_start(leaves, *args)

    monkeypatch.setattr(writers_read, "start", recording)
    step_fn = jax.jit(lambda i: {"x": i * 0.5, "v": jnp.stack([i, -i]), "n": i > 2})
    path = tmp_path / "s.jsonl"
    with AsyncWriter(JsonlWriter(path), defer_fetch=True, background_fetch=False) as w:
        for step in range(5):
            w.write(step, step_fn(jnp.float32(step)))
            assert started == [3] * (step + 1)  # this step's copies run from now
    want = [
        {"step": i, "x": i * 0.5, "v": [float(i), -float(i)], "n": int(i > 2)}
        for i in range(5)
    ]
    assert read_jsonl(path) == want


def test_defer_fetch_hands_a_writer_with_its_own_fetch_the_summaries() -> None:
    seen: list[type] = []

    class OwnFetch(Recorder):
        def fetch(self, step: Any, summaries: Any) -> HostSummaries:
            seen.append(type(summaries))
            return super().fetch(step, summaries)

    inner = OwnFetch()
    with AsyncWriter(inner, defer_fetch=True, background_fetch=False) as w:
        w.write(0, {"x": jnp.float32(1)})
        w.write(1, {"x": jnp.float32(2)})
    assert seen == [dict, dict]  # not the prefetched form: its `fetch` is its own
    assert inner.steps == [0, 1]


def test_async_errors_on_the_calling_thread() -> None:
    w = AsyncWriter(Recorder(), background_fetch=False, defer_fetch=False)
    with pytest.raises(ValueError, match="step must be >= 0"):
        w.write(-1, {"x": 1.0})
    with pytest.raises(
        TypeError, match=r"`Recorder.write`: the value at 'x' has type str"
    ):
        w.write(0, {"x": "text"})
    w.close()


@pytest.mark.parametrize(
    ("max_pending", "error", "message"),
    [
        (0, ValueError, r"got 0"),
        (1.5, TypeError, r"got float 1\.5"),
        ("8", TypeError, r"got str '8'"),
        (True, TypeError, r"got bool True"),
    ],
)
def test_async_max_pending_must_be_a_positive_int(
    max_pending: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(
        error,
        match=r"^`AsyncWriter\(writer, max_pending=\.\.\.\)`: max_pending must be "
        r"an int >= 1 \(the most steps waiting for the background thread\), " + message,
    ):
        AsyncWriter(Recorder(), max_pending=max_pending)
    with AsyncWriter(Recorder(), max_pending=np.int64(1)) as w:
        assert w.max_pending == 1
        assert type(w.max_pending) is int


_MODES = pytest.mark.parametrize(
    ("defer_fetch", "background_fetch"), [(False, True), (False, False), (True, False)]
)


@_MODES
def test_async_writes_the_values_at_the_time_of_write(
    tmp_path: Path, defer_fetch: bool, background_fetch: bool
) -> None:
    # The caller reuses its containers and NumPy buffers after each `write`; the
    # background thread waits at a gate until all of that is done.
    gate = threading.Event()
    inner = MultiWriter(Recorder(gate=gate), JsonlWriter(tmp_path / "s.jsonl"))
    w = AsyncWriter(inner, defer_fetch=defer_fetch, background_fetch=background_fetch)
    summaries: dict[str, Any] = {}
    nested: dict[str, Any] = {}
    buf = np.zeros(2)
    field = np.zeros(())  # a NumPy field of a summary (built like a fetched one)
    host_sum = jax.tree_util.tree_map(lambda _: field, eqxctx.SumSummary(0.0))
    rows = np.zeros(2)
    for step in range(3):
        summaries["loss"] = float(step)
        summaries["x"] = jnp.float32(10 * step)
        buf[:] = step
        summaries["buf"] = buf
        field[...] = 100 * step
        summaries["sum"] = host_sum
        nested["acc"] = -step
        summaries["eval"] = nested
        summaries["cb"] = eqxctx.CallbackSummary(np.sum, buf)  # NumPy args
        rows[:] = [step, -step]  # the stacked rows of a scan's iterations
        # (A collection copies the NumPy arrays it is made of: `rows` is reused.)
        iterations = eqxctx.IterationSummaries(2, {"v": rows})
        summaries["scan"] = eqxctx.OutputCollection({"iter": iterations}, {}, {})
        w.write(step, summaries)
    summaries.clear()
    nested["acc"] = 99
    buf[:] = -1
    field[...] = -1
    rows[:] = -1
    gate.set()
    w.close()
    assert read_jsonl(tmp_path / "s.jsonl") == [
        {
            "step": s,
            "loss": float(s),
            "x": 10.0 * s,
            "buf": [float(s), float(s)],
            "sum": 100.0 * s,
            "eval/acc": -s,
            "cb": 2.0 * s,
            "scan/iter0/v": float(s),
            "scan/iter1/v": -float(s),
        }
        for s in range(3)
    ]


def test_async_keeps_jax_arrays_and_read_only_collections() -> None:
    from eqxctx.writers._async import _snapshot  # pyright: ignore[reportPrivateUsage]

    x = jnp.arange(3.0)
    coll = eqxctx.OutputCollection({"x": x, "m": eqxctx.MomentsSummary(x)}, {}, {})
    assert _snapshot(coll) is coll  # nothing the caller can change: no copy
    nested = {"a": x, "b": {"c": 1.0}, "coll": coll}
    snap: Any = _snapshot(nested)
    assert list(snap) == ["a", "b", "coll"]
    assert snap is not nested  # new mappings
    assert snap["b"] is not nested["b"]
    assert snap["b"] == {"c": 1.0}
    assert snap["a"] is x  # the JAX array itself: no device copy
    assert snap["coll"] is coll
    # A NumPy array in a collection: a copy, the rest of it kept.
    host = eqxctx.OutputCollection(
        {"x": np.arange(3.0), "m": eqxctx.MomentsSummary(x)}, {}, {}
    )
    assert type(host.summaries["x"]) is np.ndarray
    snap = _snapshot(host)
    assert snap is not host.summaries
    assert snap["x"] is not host.summaries["x"]
    np.testing.assert_array_equal(snap["x"], [0.0, 1.0, 2.0])
    assert snap["m"] is host.summaries["m"]
    assert list(snap) == ["x", "m"]


def test_async_defer_fetch_error_names_its_step_and_keeps_the_next(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.jsonl"
    w = AsyncWriter(JsonlWriter(path), defer_fetch=True, background_fetch=False)
    w.write(0, {"x": 0.0})
    w.write(1, {"img": eqxctx.ImageSummary(jnp.zeros((0, 2, 2)))})  # invalid
    with pytest.raises(ValueError, match=r"the summary at 'img'.*no image") as info:
        w.write(2, {"x": 2.0})  # fetches step 1
    assert info.value.__notes__ == [
        "Raised by eqxctx's AsyncWriter(defer_fetch=True) fetching step 1, one "
        "step late: step 1 is not written; the step passed to this call, if any, "
        "is kept."
    ]
    w.write(3, {"x": 3.0})
    w.write(4, {"x": "text"})  # invalid, fetched by close
    with pytest.raises(
        TypeError, match=r"`JsonlWriter.write`: the value at 'x'"
    ) as info:
        w.close()
    assert "fetching step 4" in info.value.__notes__[0]
    assert read_jsonl(path) == [{"step": s, "x": float(s)} for s in (0, 2, 3)]


@pytest.mark.parametrize("background_fetch", [True, None])
def test_async_background_fetch_runs_on_the_thread_and_keeps_values(
    background_fetch: bool | None,
) -> None:
    # None: the default, which never waits for the device on the calling thread
    # in one process (issue 39): the fetch runs on the background thread.
    threads: list[str] = []

    def record(x: Any) -> Any:
        threads.append(threading.current_thread().name)
        assert isinstance(x, np.ndarray)  # fetched: NumPy, as on the calling thread
        return x * 2

    inner = Recorder()
    summaries = {
        "x": jnp.float32(1.0),
        "cb": eqxctx.CallbackSummary(record, jnp.float32(3)),
    }
    kwargs = {} if background_fetch is None else {"background_fetch": True}
    with AsyncWriter(inner, **kwargs) as w:
        w.write(0, summaries)
        summaries["x"] = jnp.float32(-1.0)  # the caller's mapping may change now
        w.write(1, summaries)
    assert threads == ["eqxctx-AsyncWriter"] * 2
    assert inner.steps == [0, 1]
    assert [float(v["x"]) for v in inner.values] == [1.0, -1.0]
    assert [float(v["cb"]) for v in inner.values] == [6.0, 6.0]


def test_async_background_fetch_error_raises_on_the_next_call() -> None:
    inner = Recorder()
    w = AsyncWriter(inner, background_fetch=True)
    w.write(0, {"x": 1.0})
    w.write(1, {"x": "text"})  # refused by the fetch, on the thread
    with pytest.raises(
        TypeError, match=r"`Recorder.write`: the value at 'x' has type str"
    ) as info:
        w.flush()
    assert "failed writing step 1 with Recorder" in "".join(info.value.__notes__)
    with pytest.raises(ValueError, match=r"failed at step 1.*close this writer"):
        w.write(2, {"x": 2.0})
    w.close()
    assert inner.steps == [0]


@pytest.mark.parametrize("defer_fetch", [False, True])
def test_async_several_processes_fetch_on_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch, defer_fetch: bool
) -> None:
    # A fetch may be a collective: with several processes it stays in program order.
    threads: list[str] = []

    def record(x: Any) -> Any:
        threads.append(threading.current_thread().name)
        return x

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    inner = Recorder()
    # (The default defers: step n is fetched at the write of step n + 1.)
    kwargs = {} if defer_fetch else {"defer_fetch": False}
    with AsyncWriter(inner, **kwargs) as w:
        for step in range(3):
            w.write(step, {"x": eqxctx.CallbackSummary(record, jnp.float32(step))})
            # Fetched before `write` returned (the previous step, if deferred).
            assert len(threads) == step + (not defer_fetch)
    assert set(threads) == {threading.main_thread().name}
    assert inner.steps == [0, 1, 2]
    assert [float(v["x"]) for v in inner.values] == [0.0, 1.0, 2.0]


def test_multi_writer_checks_all_before_writing_any(tmp_path: Path) -> None:
    jsonl = JsonlWriter(tmp_path / "s.jsonl")
    tb = TensorBoardWriter(tmp_path)
    with MultiWriter(jsonl, tb) as w:
        with pytest.raises(eqxctx.OutputConflictError, match="'a b'"):
            w.write(0, {"a b": 1.0, "a_b": 2.0})  # TensorBoard refuses it
        w.write(1, {"x": np.float32(0.5)})
    assert read_jsonl(tmp_path / "s.jsonl") == [{"step": 1, "x": 0.5}]
    assert scalars(str(tmp_path)) == {(1, "x"): 0.5}
    with pytest.raises(ValueError, match="at least one writer"):
        MultiWriter()


def test_multi_writer_closes_all_and_raises_the_first_error() -> None:
    class Failing(Recorder):
        def close(self) -> None:
            super().close()
            raise OSError("close failed")

    a, b = Failing(), Recorder()
    with pytest.raises(OSError, match="close failed"):
        MultiWriter(a, b).close()
    assert a.closed
    assert b.closed


def test_multi_writer_writes_and_flushes_with_every_writer() -> None:
    class FailingFlush(Recorder):
        def flush(self) -> None:
            super().flush()
            raise OSError("flush failed")

    a, b, c = Recorder(fail_at=1), FailingFlush(), Recorder()
    w = MultiWriter(a, b, c)
    for step in range(3):
        if step == 1:
            with pytest.raises(OSError, match="disk full at 1"):
                w.write(step, {"x": float(step)})
        else:
            w.write(step, {"x": float(step)})
    assert (a.steps, b.steps, c.steps) == ([0, 2], [0, 1, 2], [0, 1, 2])
    with pytest.raises(OSError, match="flush failed") as info:
        w.flush()
    assert (a.flushes, b.flushes, c.flushes) == (1, 1, 1)
    b2 = FailingFlush()
    with pytest.raises(OSError, match="flush failed") as info:
        MultiWriter(FailingFlush(), b2).flush()
    assert b2.flushes == 1
    assert any(
        "FailingFlush.flush also raised OSError" in n for n in info.value.__notes__
    )


def test_writers_doc_examples_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = Path(__file__).parent.parent / "docs" / "api" / "writers.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.DOTALL)
    assert len(blocks) == 3
    monkeypatch.setattr(tempfile, "mkdtemp", lambda: str(tmp_path))
    exec(compile("\n".join(blocks), str(doc), "exec"), {})
    assert [line["step"] for line in read_jsonl(tmp_path / "async.jsonl")] == [0, 1, 2]
    buffered = read_jsonl(tmp_path / "buffered.jsonl")  # issue 39
    assert [line["step"] for line in buffered] == list(range(40))
    assert buffered[3]["train/loss"] == pytest.approx(np.exp(-0.3), rel=1e-6)
    assert len(read_jsonl(tmp_path / "summaries.jsonl")) == 3
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2


@pytest.mark.parametrize("defer_fetch", [False, True])
def test_async_several_processes_keep_fetching_after_a_failure(
    monkeypatch: pytest.MonkeyPatch, defer_fetch: bool
) -> None:
    # Each write's fetch may be a collective: after a background failure on
    # process 0, process 0 still fetches every step (in step with the other
    # processes, which keep fetching) and raises after the fetch.
    fetched: list[int] = []

    def record(x: Any) -> Any:
        fetched.append(int(x))
        return x

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    inner = Recorder(fail_at=1)
    w = AsyncWriter(inner, defer_fetch=defer_fetch)
    raised: list[type[BaseException]] = []
    for step in range(5):
        try:
            w.write(step, {"x": eqxctx.CallbackSummary(record, jnp.int32(step))})
        except (OSError, ValueError) as e:
            raised.append(type(e))
        time.sleep(0.05)  # let the thread reach the failure
    try:
        w.close()
    except (OSError, ValueError) as e:
        raised.append(type(e))
    assert fetched == [0, 1, 2, 3, 4]  # every step fetched, the last at close
    assert inner.steps == [0]
    assert raised[0] is OSError  # the failure, raised once; then ValueErrors
    assert set(raised[1:]) <= {ValueError}
    assert inner.closed


def test_async_error_at_exit_does_not_replace_the_blocks_exception() -> None:
    inner = Recorder(fail_at=0)
    with (  # noqa: PT012
        pytest.raises(KeyError, match="user bug") as info,
        AsyncWriter(inner) as w,
    ):
        w.write(0, {"x": 1.0})
        while inner.attempts == 0:  # the background write has failed
            time.sleep(0.01)
        raise KeyError("user bug")
    notes = getattr(info.value, "__notes__", [])
    assert any("AsyncWriter" in n and "disk full at 0" in n for n in notes), notes
    assert inner.closed


UNCLOSED = """
import sys
import jax.numpy as jnp
from eqxctx.writers import AsyncWriter, JsonlWriter
defer = sys.argv[2] == "defer"  # else the default: fetched on the thread
w = AsyncWriter(JsonlWriter(sys.argv[1]), background_fetch=not defer)
for step in range(20):
    w.write(step, {"x": jnp.float32(step), "y": jnp.arange(3.0) * step})
if sys.argv[2] == "raise":
    raise RuntimeError("diverged")
"""


@pytest.mark.parametrize(("mode", "rc"), [("raise", 1), ("defer", 0)])
def test_an_unclosed_async_writer_writes_every_step_at_exit(
    tmp_path: Path, mode: str, rc: int
) -> None:
    # Never closed (an exception outside a `with`, or a forgotten `close`): the
    # interpreter's exit writes what is pending, and exits normally (the last
    # step's host arrays, kept by the thread, aborted it at shutdown).
    path = tmp_path / "s.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", UNCLOSED, str(path), mode],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == rc, done.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(path)] == list(range(20))
    assert read_jsonl(path)[-1]["y"] == [0.0, 19.0, 38.0]
