"""Put this rank's stage on this rank's device: move or materialize its tensors, free the rest.

Every rank starts from the whole model object, built on the CPU (host memory) or on the
meta device (``with torch.device("meta"): model = Net()``), which holds no data at all.
After the plan, each rank keeps only the parameters and buffers its stage uses:

* a tensor with data is copied to the rank's device;
* a tensor on ``meta`` is allocated there and initialized by the modules that own it (under
  any of its names): ``init(module)`` when the user gives one, else the module's own
  ``reset_parameters()``, in model order, each module from a seed made of one seed shared
  by all ranks and the module's name, so that replicas of a stage and every stage holding a
  tied weight draw the same values;
* every other tensor of the model is freed (``t.data`` becomes empty).

The placed tensors replace the old ones wherever rannc_fx can see them: in the model, the
stage's GraphModule, the captured graph and the user's optimizer, whose param groups and
hyperparameters carry over untouched. (``torch.utils.swap_tensors`` would keep the objects,
but export's fake-tensor caches hold weak references to them, which it refuses.)

A materialized tensor no init touched is *pending*: it must be loaded from a checkpoint
before the first step (``Placement.check_initialized``). A non-persistent buffer or a plain
tensor attribute (a graph constant) cannot be loaded from one, so if no init computed it,
placement fails at once and names it. A buffer or constant that several stages read is placed
on each of their ranks like any other tensor of the stage: copied, or computed by its
modules' init on every rank that holds it.
"""

from __future__ import annotations

import logging
import operator
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils.weak import WeakIdKeyDictionary

from ..runtime.lane import LaneModules, graph_modules

__all__ = ["InitFn", "Placement", "free_others", "place_stage", "rank_device", "stage_tensors"]

log = logging.getLogger("rannc_fx")

InitFn = Callable[[nn.Module], None]


def rank_device(requested: str | None = None) -> torch.device:
    """``requested`` (``"cuda"`` means ``cuda:LOCAL_RANK``), else ``cuda:LOCAL_RANK`` when
    CUDA is available, else the CPU."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if requested is not None:
        dev = torch.device(requested)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local)
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", local % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


@dataclass
class Placement:
    """What placing the stage did: tensors moved, materialized, initialized and freed."""

    device: torch.device
    moved_bytes: int = 0
    materialized_bytes: int = 0
    freed_bytes: int = 0
    pending: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> tensor
    # the objects placement replaced, old -> new: an optimizer group added later may name a
    # parameter by a reference taken before compile (``runtime/trainable.py``)
    replaced: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)

    def loaded(self, tensors: list[torch.Tensor]) -> None:
        """These tensors were filled from a checkpoint: no longer pending."""
        done = {id(t) for t in tensors}
        self.pending = {n: t for n, t in self.pending.items() if id(t) not in done}

    def check_initialized(self) -> None:
        if not self.pending:
            return
        names = sorted(self.pending)
        shown = ", ".join(repr(n) for n in names[:8]) + (" ..." if len(names) > 8 else "")
        raise RuntimeError(
            f"{len(names)} tensor(s) of this rank's stage were allocated from the meta device "
            f"but never initialized: {shown}; their modules have no reset_parameters(). Pass "
            "compile(..., init=fn) (fn(module) initializes a module's own tensors; for a "
            "transformers model, init=model._init_weights), or load a checkpoint with "
            "rannc_fx.set_state_dict(...) before the first step"
        )


def place_stage(
    model: nn.Module,
    stage: fx.GraphModule | LaneModules,
    device: torch.device,
    *,
    holders: tuple[nn.Module, ...] = (),
    optimizer: torch.optim.Optimizer | None = None,
    init: InitFn | None = None,
    seed: int = 0,
    host_params: bool = False,
) -> Placement:
    """Move or materialize ``stage``'s tensors on ``device``, in ``model``, ``stage``, the
    other module trees in ``holders`` and ``optimizer``; then ``free_others``. With
    ``host_params`` the parameters go to host memory instead (pinned where the device is a
    GPU, so that their copies to it can overlap the compute)."""
    placement = Placement(device)
    new: dict[int, torch.Tensor] = {}
    materialized: list[torch.Tensor] = []
    host = torch.device("cpu")
    with torch.no_grad():
        for t in stage_tensors(stage).values():
            where = host if host_params and isinstance(t, nn.Parameter) else device
            pin = where != device and device.type == "cuda"
            if t.device.type == "meta":
                new[id(t)] = _allocate(t, where, pin=pin)
                materialized.append(new[id(t)])
                placement.materialized_bytes += t.nbytes
            elif t.device != where or (pin and not t.is_pinned()):
                new[id(t)] = _copy(t, where, pin=pin)
                placement.moved_bytes += t.nbytes
            else:
                continue
            placement.replaced[t] = new[id(t)]
        _replace(new, (model, stage, *holders), optimizer)
        if materialized:
            _initialize(model, materialized, init, seed, device, placement)
    return placement


def free_others(model: nn.Module, stage: fx.GraphModule | LaneModules,
                placement: Placement) -> None:
    """Release the storage of every tensor of ``model`` that ``stage`` does not use.

    The objects stay (user code may still refer to them) but hold nothing.
    """
    keep = stage_tensors(stage)
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if id(t) not in keep and t.numel():
                placement.freed_bytes += t.nbytes if t.device.type != "meta" else 0
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                t.grad = None
    log.info(
        "placed stage on %s: %.1f MiB moved, %.1f MiB materialized, %.1f MiB of other stages "
        "freed", placement.device, placement.moved_bytes / 2**20,
        placement.materialized_bytes / 2**20, placement.freed_bytes / 2**20,
    )  # fmt: skip


def stage_tensors(stage: fx.GraphModule | LaneModules) -> dict[int, torch.Tensor]:
    """Parameters, buffers and plain tensor attributes the stage (or each stage of a rank's
    lane) reads, by identity."""
    out: dict[int, torch.Tensor] = {}
    for t in (*stage.parameters(), *stage.buffers()):
        out.setdefault(id(t), t)
    for gm in graph_modules(stage):
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                value = operator.attrgetter(str(n.target))(gm)
                if isinstance(value, torch.Tensor):
                    out.setdefault(id(value), value)
    return out


# -- helpers ---------------------------------------------------------------------------------


def _owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str, str]]]:
    """id(tensor) -> (module name, module, attribute, "parameter" / "buffer" / "attribute")
    for every place the model holds it; "attribute": a plain tensor attribute (a constant)."""
    out: dict[int, list[tuple[str, nn.Module, str, str]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((mname, mod, attr, "parameter"))
        for attr, b in mod._buffers.items():
            if b is not None:
                out.setdefault(id(b), []).append((mname, mod, attr, "buffer"))
        for attr, v in _plain_tensors(mod):
            out.setdefault(id(v), []).append((mname, mod, attr, "attribute"))
    return out


def _plain_tensors(mod: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensor attributes that are neither parameters nor buffers (``self.scale = tensor``)."""
    return [(k, v) for k, v in vars(mod).items() if isinstance(v, torch.Tensor)]


def _allocate(t: torch.Tensor, device: torch.device, *, pin: bool = False) -> torch.Tensor:
    new = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
    if new.is_floating_point() or new.is_complex():
        new.fill_(float("nan"))  # what no init wrote stays visible as NaN
    else:
        new.zero_()
    return _like(t, new)


def _copy(t: torch.Tensor, device: torch.device, *, pin: bool = False) -> torch.Tensor:
    data = t.detach().to(device, copy=True)
    return _like(t, data.pin_memory() if pin else data)


def _like(t: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    if isinstance(t, nn.Parameter):
        return nn.Parameter(data, requires_grad=t.requires_grad)
    return data.requires_grad_(t.requires_grad)


def _replace(new: dict[int, torch.Tensor], roots: tuple[nn.Module, ...],
             optimizer: torch.optim.Optimizer | None) -> None:
    """Put ``new[id(old)]`` wherever ``old`` is held: module parameters, buffers and tensor
    attributes of every module under ``roots``, and the optimizer's groups and state."""
    seen: set[int] = set()
    for root in roots:
        for mod in root.modules():
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            for table in (mod._parameters, mod._buffers):
                for k, v in table.items():
                    if v is not None and id(v) in new:
                        table[k] = new[id(v)]  # type: ignore[assignment]
            for k, v in list(vars(mod).items()):
                if isinstance(v, torch.Tensor) and id(v) in new:
                    setattr(mod, k, new[id(v)])
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [new.get(id(p), p) for p in group["params"]]
        for p in list(optimizer.state):
            if id(p) in new:
                optimizer.state[new[id(p)]] = optimizer.state.pop(p)


def _initialize(
    model: nn.Module,
    materialized: list[torch.Tensor],
    init: InitFn | None,
    seed: int,
    device: torch.device,
    placement: Placement,
) -> None:
    """Run the init of every module owning a materialized tensor, in model order."""
    owners = _owners(model)
    wanted = {name for t in materialized for name, *_ in owners.get(id(t), [])}
    done: set[int] = set()
    touched: set[int] = set()  # tensors some init was run for
    devices = [device] if device.type == "cuda" else []
    for mname, mod in model.named_modules(remove_duplicate=False):
        if mname not in wanted or id(mod) in done:
            continue
        done.add(id(mod))
        fn = _init_of(mod, init)
        if fn is None:
            continue
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed((seed + zlib.crc32(mname.encode())) % 2**63)
            fn()
        touched.update(id(t) for t in (*mod._parameters.values(), *mod._buffers.values())
                       if t is not None)
        touched.update(id(t) for _, t in _plain_tensors(mod))
    for t in materialized:
        still_nan = (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any())
        if id(t) in touched and not still_nan:
            continue
        held = owners.get(id(t), [])
        names = [_qualified(m, a) for m, _, a, kind in held if kind != "attribute"]
        if not names:  # a plain tensor attribute: no checkpoint holds it either
            what = (
                f"tensor attribute {_qualified(held[0][0], held[0][2])!r} "
                f"({type(held[0][1]).__name__})" if held else "a tensor constant of the graph"
            )
            raise RuntimeError(
                f"{what} of this rank's stage is on the meta device and nothing computed it; it "
                "is neither a parameter nor a buffer, so no checkpoint holds it: register it as "
                "a buffer (persistent=False and computed in reset_parameters() if it follows "
                "from the configuration), compute it in compile(..., init=fn), or build the "
                "model on the CPU"
            )
        for m, owner, a, kind in held:
            if kind == "buffer" and a in owner._non_persistent_buffers_set:
                raise RuntimeError(
                    f"non-persistent buffer {_qualified(m, a)!r} ({type(owner).__name__}) of "
                    "this rank's stage is on the meta device and nothing computed it: it is not "
                    f"in any checkpoint, so it must be computed by {type(owner).__name__}."
                    "reset_parameters() or by compile(..., init=fn) (for a transformers model, "
                    "init=model._init_weights recomputes rotary caches); or build the model on "
                    "the CPU"
                )
        placement.pending[names[0]] = t


def _init_of(mod: nn.Module, init: InitFn | None) -> Callable[[], None] | None:
    """What initializes ``mod``'s own tensors: the user's ``init``, else its own reset."""
    if not (mod._parameters or mod._buffers or _plain_tensors(mod)):
        return None
    if init is not None:
        return lambda: init(mod)
    for name in ("reset_parameters", "_reset_parameters"):  # nn.MultiheadAttention: private
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn
    return None


def _qualified(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr
