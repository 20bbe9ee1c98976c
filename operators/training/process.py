"""One object in a process of its own: `Child(factory, args, threads=1)` builds `factory(*args)` in a
spawned process; `call(method, *args)` runs the method there and returns its result or raises its
exception. A train node with `own_process: {threads: N}` keeps its trainer in one.

Why: threads of one process share one GIL. On the 2-core CI machine a quickstart train step took
242 ms next to a running embedded engine in the same process against 189 ms alone, and 190 ms with
the engine in another process (one torch thread each); so an async pipeline's generation only
overlaps training for real when they run in different processes. The Ray executor gives every stage
a process; this gives the train node one under the in-process executor.

Messages are pickled and sent through a pipe, CPU tensors as their bytes (the weight transports'
`as_bytes`): a multiprocessing pipe would use torch's shared-memory reductions (a file descriptor per
tensor), and torch's own pickling writes a zip archive per tensor: pickling and unpickling the
quickstart's 1.6 MB of weights took 14.3 ms that way and 2.7 ms this way. Calls are answered in
order (`call` blocks; run it in a thread from async code). A child that dies (killed, out of memory)
raises `ChildDied` in the caller, with its exit code; an exception in the child is re-raised in the
caller as itself (or a RuntimeError if it cannot be pickled), with the child's traceback as a note.
"""

from __future__ import annotations

import io
import multiprocessing
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from flowrl.data import images
from flowrl_operators.transport.base import TensorMeta, as_bytes, from_bytes


class ChildDied(RuntimeError):
    """The child process ended while a call was pending."""


class Child:
    def __init__(self, factory: Callable[..., Any], args: tuple = (), *, threads: int | None = None,
                 name: str = "flowrl-child") -> None:
        context = multiprocessing.get_context("spawn")  # fork would copy the parent's torch threads
        self._conn, child_end = context.Pipe()
        # The child reads images (vision-language batches) from the parent's store: the run's folder.
        store = str(images.store().root)
        self.process = context.Process(target=_serve, args=(child_end, factory, args, threads, store), name=name,
                                       daemon=True)
        self.process.start()
        child_end.close()
        self._lock = threading.Lock()
        self._answer()  # the object is built (or its constructor's error is raised here)

    def call(self, method: str, *args: Any) -> Any:
        """Run `method(*args)` on the object in the child; blocks until it answers."""
        with self._lock:
            try:
                self._conn.send_bytes(_dumps((method, args)))
            except (BrokenPipeError, OSError) as e:
                raise self._died() from e
            return self._answer()

    def close(self, timeout: float = 30.0) -> None:
        """Ask the child to return, wait up to `timeout` s, then terminate it."""
        if self.process.is_alive():
            try:
                with self._lock:
                    self._conn.send_bytes(_dumps((None, ())))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        self._conn.close()

    def _answer(self) -> Any:
        try:
            kind, value, trace = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise self._died() from e
        if kind == "ok":
            return value
        value.add_note(f"in the process '{self.process.name}':\n{trace}")
        raise value

    def _died(self) -> ChildDied:
        self.process.join(5)
        return ChildDied(f"the process '{self.process.name}' (pid {self.process.pid}) exited with code "
                         f"{self.process.exitcode} while a call was pending; its own output above says why "
                         "(a negative code is the signal that killed it, e.g. -9 for out of memory)")


def _serve(conn: Any, factory: Callable[..., Any], args: tuple, threads: int | None, store: str) -> None:
    # Ctrl-C reaches the whole process group; the parent then checkpoints through this process, so
    # only the parent decides when it ends (close, or the pipe's end when the parent is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads is not None:
        torch.set_num_threads(threads)
    images.use_store(store)
    try:
        obj = factory(*args)
    except BaseException as e:
        conn.send_bytes(_reply("error", e))
        return
    conn.send_bytes(_reply("ok", None))
    while True:
        try:
            method, call_args = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent went away
            return
        if method is None:
            conn.send_bytes(_reply("ok", None))
            return
        try:
            conn.send_bytes(_reply("ok", getattr(obj, method)(*call_args)))
        except BaseException as e:
            conn.send_bytes(_reply("error", e))


def _reply(kind: str, value: Any) -> bytes:
    trace = "".join(traceback.format_exception(value)) if kind == "error" else ""
    try:
        return _dumps((kind, value, trace))
    except Exception:  # an unpicklable result or exception: say so with the child's traceback
        message = f"{type(value).__name__}: {value}" if kind == "error" else "a result that cannot be pickled"
        return _dumps(("error", RuntimeError(message), trace))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided \
                and not obj.requires_grad:
            return _from_array, (as_bytes(obj).numpy(), TensorMeta.of("", obj))
        return NotImplemented  # anything else (CUDA, autograd tensors): torch's own pickling


def _from_array(array: Any, meta: TensorMeta) -> torch.Tensor:
    return from_bytes(torch.from_numpy(array), meta)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()
