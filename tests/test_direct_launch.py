"""kernels/launch.py's DirectLauncher on a stand-in JIT function (no GPU here): the first call of a
specialisation class and every call under a launch hook go through the JIT; later calls hand the compiled
kernel's launcher the plain arguments followed by the constexprs, in signature order."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")


class _Kernel:
    def __init__(self, log):
        self.function, self.packed_metadata, self.log = "fn", ("packed",), log

    def run(self, *a):
        self.log.append(("direct", a))


class _Jit:
    def __init__(self, arg_names=("desc", "ptr", "n", "scale", "CAUSAL", "STAGES")):
        self.arg_names, self.log = list(arg_names), []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            return _Kernel(self.log)
        return launch


@pytest.fixture
def launcher(monkeypatch):
    from flashport.kernels import launch
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(launch.Desc, "real", lambda self: ("real", self.block_shape))
    return launch, _Jit()


def test_first_call_jits_later_calls_launch_directly(launcher):
    launch, jit = launcher
    direct = launch.DirectLauncher(jit)
    t = torch.zeros(64, 8)
    desc = launch.Desc(t, [64, 8], [8, 1], (16, 8), "layout")
    meta = dict(CAUSAL=True, STAGES=2, num_warps=4)
    direct((4, 2), (desc, t, 48, 0.5), meta)
    assert jit.log[-1] == ("jit", (4, 2), (("real", (16, 8)), t, 48, 0.5), meta)
    direct((4, 2), (desc, t, 64, 0.25), meta)      # 48 and 64: both multiples of 16, one class
    assert jit.log[-1] == ("direct", (4, 2, 1, 1234, "fn", ("packed",), None, None, None, desc, t, 64, 0.25,
                                      True, 2))
    assert len(jit.log) == 2


@pytest.mark.parametrize("change", ["int 1", "int not /16", "int64", "constexpr", "dtype", "block shape", "layout",
                                    "misaligned"])
def test_a_new_specialisation_class_goes_through_the_jit(launcher, change):
    launch, jit = launcher
    direct = launch.DirectLauncher(jit)
    t = torch.zeros(64, 8)
    args = [launch.Desc(t, [64, 8], [8, 1], (16, 8), "layout"), t, 48, 0.5]
    meta = dict(CAUSAL=True, STAGES=2, num_warps=4)
    direct((1,), tuple(args), meta)
    if change == "int 1":
        args[2] = 1                      # Triton compiles an int equal to 1 in as a constant
    elif change == "int not /16":
        args[2] = 40
    elif change == "int64":
        args[2] = 2 ** 32                # past int32: Triton passes it as a 64-bit int
    elif change == "constexpr":
        meta = dict(meta, STAGES=3)
    elif change == "dtype":
        args[1] = t.half()
    elif change == "block shape":
        args[0] = launch.Desc(t, [64, 8], [8, 1], (32, 8), "layout")
    elif change == "layout":
        args[0] = launch.Desc(t, [64, 8], [8, 1], (16, 8), "another layout")
    else:
        args[1] = t.view(-1)[1:]         # 4 bytes past a 16-byte boundary
    direct((1,), tuple(args), meta)
    assert [e[0] for e in jit.log] == ["jit", "jit"]


def test_launch_hooks_see_every_call(launcher):
    from triton import knobs
    launch, _ = launcher
    jit = _Jit(("t", "CAUSAL", "STAGES"))
    direct = launch.DirectLauncher(jit)
    t = torch.zeros(16)
    direct((1,), (t,), dict(CAUSAL=False, STAGES=2))
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        direct((1,), (t,), dict(CAUSAL=False, STAGES=2))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    direct((1,), (t,), dict(CAUSAL=False, STAGES=2))
    assert [e[0] for e in jit.log] == ["jit", "jit", "direct"]


def test_unbound_names_what_a_direct_launch_would_get_wrong():
    """unbound(args, meta): a constexpr passed positionally, a parameter after the args missing from meta, a tensor
    in meta (part of the key by value); empty for the JIT's own binding."""
    import triton.language as tl
    from flashport.kernels import launch

    def kernel(X, n, T, m, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
        pass

    class Fn:
        fn, arg_names = staticmethod(kernel), ["X", "n", "T", "m", "BLOCK", "FLAG"]
    direct, t = launch.DirectLauncher(Fn()), torch.zeros(4)
    assert direct.unbound((t, 3, t, 5), dict(BLOCK=16, FLAG=True, num_warps=4)) == []
    assert direct.unbound((t, 3, t, 5, 16), dict(FLAG=True)) == ["constexpr BLOCK passed positionally"]
    assert direct.unbound((t, 3, t, 5), dict(BLOCK=16)) == ["FLAG not in meta"]
    assert direct.unbound((t, 3), dict(T=t, m=5, BLOCK=16, FLAG=False)) == ["tensor T in meta"]
    assert direct.unbound((t, 3), dict(T=(t, t), m=5, BLOCK=16, FLAG=False)) == ["tensor T in meta"]


def test_tuple_arguments_are_specialised_per_element(launcher):
    """A tuple argument (the compiled mods' captured tensors) is keyed by its elements' classes, as Triton
    specialises them: a new dtype or alignment inside it goes through the JIT."""
    launch, jit = launcher
    direct = launch.DirectLauncher(_Jit(("caps", "n", "STAGES")))
    t = torch.zeros(64)
    direct((1,), ((t, t), 48), dict(STAGES=2))
    direct((1,), ((t, t.clone()), 64), dict(STAGES=2))     # same classes: direct
    direct((1,), ((t, t.half()), 48), dict(STAGES=2))      # a new dtype inside the tuple
    direct((1,), ((t, t[1:]), 48), dict(STAGES=2))         # misaligned inside the tuple
    assert [e[0] for e in direct.jit_fn.log] == ["jit", "direct", "jit", "jit"]


def test_the_triton_kernels_launch_directly_by_default_and_roll_back(monkeypatch):
    """launch.triton_direct: on by default for CUDA tensors (PERFLOG row 96: bitwise the same results, less host
    time), FLASHPORT_TRITON_DIRECT=0 rolls back to JITFunction.run; CPU tensors (the interpreter) always take the JIT."""
    from types import SimpleNamespace

    from flashport.kernels import launch
    monkeypatch.delenv("FLASHPORT_TRITON_DIRECT", raising=False)
    cuda = SimpleNamespace(is_cuda=True)   # a stand-in: no GPU here
    assert launch.triton_direct(cuda)
    assert not launch.triton_direct(torch.empty(1))
    monkeypatch.setenv("FLASHPORT_TRITON_DIRECT", "0")
    assert not launch.triton_direct(cuda)
