"""ckptfs_load: load checkpoints (rank shards or consolidated safetensors) into torch tensors.

A thin ctypes binding over libckptfs_load.so (include/ckptfs/load/ckptfs_load.h). The library
is found through $CKPTFS_LOAD_LIB (a path to the .so), else the repository's build/src, else
the system's library path.

    from ckptfs_load import load_state_dict, load_into
    sd = load_state_dict("/ckpt/step_100/model", device="cuda:0")   # dict[str, torch.Tensor]
    load_into(model, "/ckpt/step_100/model")                          # fills parameters in place
    model = from_pretrained("/ckpt/step_100/model")   # a transformers model, as its from_pretrained

Tensors are allocated by torch (on the CPU or the CUDA device asked for) and the library writes
into their memory (data_ptr()): no copy beyond the loader's own staging buffers. Dtypes torch
does not have (sub-byte F4/F6, and any other torch lacks in this version) come back as uint8
tensors of the raw bytes, shape (nbytes,).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
from dataclasses import dataclass

__all__ = ["Checkpoint", "Comm", "LoadError", "TensorInfo", "features", "from_pretrained",
           "load_into", "load_state_dict", "nccl_unique_id"]


class LoadError(RuntimeError):
    """A load failed; `errno` is the library's error code, the message says what and where."""

    def __init__(self, errno: int, message: str):
        super().__init__(message)
        self.errno = errno


class _Request(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dst", ctypes.c_void_p), ("bytes", ctypes.c_uint64),
                ("row_begin", ctypes.c_uint64), ("row_end", ctypes.c_uint64),
                ("has_rows", ctypes.c_int)]


class _Options(ctypes.Structure):
    _fields_ = [("device", ctypes.c_char_p), ("threads", ctypes.c_uint),
                ("chunk_bytes", ctypes.c_uint64), ("ring_slots", ctypes.c_uint),
                ("streams", ctypes.c_uint), ("checksum", ctypes.c_int),
                ("always_stage", ctypes.c_int)]


class _Stats(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint64), ("bytes_read", ctypes.c_uint64),
                ("bytes_shared", ctypes.c_uint64), ("seconds", ctypes.c_double),
                ("direct_fallback", ctypes.c_int)]


_lib = None


def _library():
    global _lib
    if _lib is not None:
        return _lib
    # torch first, when installed: the library links libcudart.so.13 and libnccl.so.2 by soname,
    # and torch must get its own builds of those (a CUDA toolkit's older libnccl loaded first
    # lacks symbols libtorch_cuda needs). Loaded after torch, the library uses torch's copies.
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    candidates = []
    if os.environ.get("CKPTFS_LOAD_LIB"):
        candidates.append(os.environ["CKPTFS_LOAD_LIB"])
    root = pathlib.Path(__file__).resolve().parents[2]
    candidates.append(str(root / "build" / "src" / "libckptfs_load.so"))
    found = ctypes.util.find_library("ckptfs_load")
    if found:
        candidates.append(found)
    for c in candidates:
        if os.path.sep in c and not os.path.exists(c):
            continue
        lib = ctypes.CDLL(c)
        break
    else:
        raise OSError("libckptfs_load.so not found: set CKPTFS_LOAD_LIB or build the project "
                      f"(looked for {candidates})")
    P, c_int, c_size = ctypes.POINTER, ctypes.c_int, ctypes.c_size_t
    lib.ckptfs_load_features.restype = c_int
    lib.ckptfs_load_huge_pages.restype = c_int
    lib.ckptfs_load_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, c_int, P(ctypes.c_void_p),
                                     ctypes.c_char_p, c_size]
    lib.ckptfs_load_open_map.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.c_char_p, c_int, P(ctypes.c_void_p),
                                         ctypes.c_char_p, c_size]
    lib.ckptfs_load_close.argtypes = [ctypes.c_void_p]
    lib.ckptfs_load_error.argtypes = [ctypes.c_void_p]
    lib.ckptfs_load_error.restype = ctypes.c_char_p
    lib.ckptfs_load_count.argtypes = [ctypes.c_void_p]
    lib.ckptfs_load_count.restype = c_size
    lib.ckptfs_load_info.argtypes = [ctypes.c_void_p, c_size, P(ctypes.c_char_p),
                                     P(ctypes.c_char_p), P(c_size), P(P(ctypes.c_uint64)),
                                     P(ctypes.c_uint64)]
    lib.ckptfs_load_run.argtypes = [ctypes.c_void_p, P(_Request), c_size, P(_Options),
                                    ctypes.c_void_p, P(_Stats), P(ctypes.c_uint64)]
    lib.ckptfs_load_nccl_unique_id.argtypes = [ctypes.c_char_p, ctypes.c_char_p, c_size]
    lib.ckptfs_load_comm_open.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, c_int,
                                          P(ctypes.c_void_p), ctypes.c_char_p, c_size]
    lib.ckptfs_load_comm_close.argtypes = [ctypes.c_void_p]
    _lib = lib
    return lib


def features() -> dict:
    f = _library().ckptfs_load_features()
    return {"cuda": bool(f & 1), "nccl": bool(f & 2)}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple
    nbytes: int


@dataclass
class Stats:
    bytes: int
    bytes_read: int
    bytes_shared: int
    seconds: float
    direct_fallback: bool
    checksums: list | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def nccl_unique_id() -> bytes:
    """A new NCCL unique id (128 bytes) for Comm; rank 0 makes it and sends it to the others."""
    buf, err = ctypes.create_string_buffer(128), ctypes.create_string_buffer(4096)
    rc = _library().ckptfs_load_nccl_unique_id(buf, err, len(err))
    if rc:
        raise LoadError(rc, err.value.decode(errors="replace"))
    return buf.raw


class Comm:
    """An NCCL communicator for read-once loading: rank `rank` of `ranks` on CUDA `device`."""

    def __init__(self, unique_id: bytes, rank: int, ranks: int, device: int):
        self._h = None
        lib, handle = _library(), ctypes.c_void_p()
        err = ctypes.create_string_buffer(4096)
        rc = lib.ckptfs_load_comm_open(unique_id, rank, ranks, device, ctypes.byref(handle), err,
                                       len(err))
        if rc:
            raise LoadError(rc, err.value.decode(errors="replace"))
        self._h = handle

    def close(self):
        if getattr(self, "_h", None):
            _library().ckptfs_load_comm_close(self._h)
            self._h = None

    def __del__(self):
        self.close()


class Checkpoint:
    """An opened, validated checkpoint directory (refused with every problem listed)."""

    def __init__(self, path, dtype: str = "auto", direct: bool = False, map: str | None = None,
                 hf_config=None):
        """map: a model map (docs/maps.md): None (built-ins detected), "none", a built-in's name
        or a .json path; hf_config: config.json for a mapped checkpoint without its own."""
        lib, handle = _library(), ctypes.c_void_p()
        err = ctypes.create_string_buffer(65536)
        rc = lib.ckptfs_load_open_map(os.fsencode(path), dtype.encode(),
                                      None if map is None else os.fsencode(map),
                                      None if hf_config is None else os.fsencode(hf_config),
                                      int(direct), ctypes.byref(handle), err, len(err))
        if rc:
            raise LoadError(rc, err.value.decode(errors="replace"))
        self._h = handle
        self.path = str(path)
        self.tensors = []
        for i in range(lib.ckptfs_load_count(handle)):
            name, dt = ctypes.c_char_p(), ctypes.c_char_p()
            ndim, shape, nbytes = ctypes.c_size_t(), ctypes.POINTER(ctypes.c_uint64)(), ctypes.c_uint64()
            lib.ckptfs_load_info(handle, i, ctypes.byref(name), ctypes.byref(dt), ctypes.byref(ndim),
                                 ctypes.byref(shape), ctypes.byref(nbytes))
            self.tensors.append(TensorInfo(name.value.decode(), dt.value.decode(),
                                           tuple(shape[d] for d in range(ndim.value)), nbytes.value))
        self.by_name = {t.name: t for t in self.tensors}

    def close(self):
        if getattr(self, "_h", None):
            _library().ckptfs_load_close(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def load(self, requests, device: str = "cpu", threads: int = 0, chunk_mb: int = 16,
             ring: int = 0, streams: int = 0, checksum: bool = False, comm: Comm | None = None,
             stage: bool = False) -> Stats:
        """requests: (name, data_ptr, nbytes) or (name, data_ptr, nbytes, (row_begin, row_end)).

        stage: host destinations through the staging ring too, as a GPU's (default: straight).
        """
        reqs = (_Request * len(requests))()
        keep = []
        for r, q in zip(reqs, requests):
            name = q[0].encode()
            keep.append(name)
            r.name, r.dst, r.bytes = name, q[1], q[2]
            if len(q) > 3 and q[3] is not None:
                r.row_begin, r.row_end, r.has_rows = q[3][0], q[3][1], 1
        opts = _Options(device.encode(), threads, chunk_mb << 20, ring, streams, int(checksum),
                        int(stage))
        stats = _Stats()
        sums = (ctypes.c_uint64 * max(1, len(requests)))()
        rc = _library().ckptfs_load_run(self._h, reqs, len(requests), ctypes.byref(opts),
                                        comm._h if comm else None, ctypes.byref(stats), sums)
        if rc:
            raise LoadError(rc, _library().ckptfs_load_error(self._h).decode(errors="replace"))
        return Stats(stats.bytes, stats.bytes_read, stats.bytes_shared, stats.seconds,
                     bool(stats.direct_fallback), list(sums)[:len(requests)] if checksum else None)


def _torch_dtype(name: str):
    import torch
    table = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
             "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
             "F32": "float32", "C64": "complex64", "F64": "float64", "I64": "int64",
             "U64": "uint64", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
             "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz",
             "F8_E5M2FNUZ": "float8_e5m2fnuz"}
    return getattr(torch, table.get(name, ""), None) if name in table else None


def _empty_for(info: TensorInfo, device):
    import torch
    dt = _torch_dtype(info.dtype)
    if dt is None:
        return torch.empty(info.nbytes, dtype=torch.uint8, device=device)
    return torch.empty(info.shape, dtype=dt, device=device)


_HUGE = 2 << 20
_libc = None


def _huge_pages_pay() -> bool:
    """Whether fresh huge pages are cheap here: the library's rule (ckptfs_load_huge_pages: not
    under a virtio balloon with free page reporting; $CKPTFS_LOAD_HUGEPAGES=1 or 0 overrides).
    On the 2-core Firecracker VM, loading 2 GB into a fresh process took 2.2-3.6 s with
    MADV_HUGEPAGE against 0.7-1.6 s without (3 runs each). The library decides once."""
    return bool(_library().ckptfs_load_huge_pages())


def _advise_huge(t) -> None:
    """madvise(MADV_HUGEPAGE) on the 2 MiB-aligned interior of a large CPU tensor not yet
    touched: first-touch page faults then cost 512x fewer (on a 2-core VM the faults of
    4 KiB pages halved the load rate, in a process re-using its freed memory). Skipped where
    fresh huge pages are dear (_huge_pages_pay). Advisory: ignored where unsupported."""
    global _libc
    n = t.numel() * t.element_size()
    if t.device.type != "cpu" or n < 4 * _HUGE or not _huge_pages_pay():
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = (t.data_ptr() + _HUGE - 1) // _HUGE * _HUGE
    end = (t.data_ptr() + n) // _HUGE * _HUGE
    if end > start:
        _libc.madvise(start, end - start, 14)  # MADV_HUGEPAGE


def _device_str(device) -> str:
    import torch
    d = torch.device(device)
    if d.type == "cuda":
        return f"cuda:{d.index if d.index is not None else torch.cuda.current_device()}"
    if d.type != "cpu":
        raise ValueError(f"device {device}: only cpu and cuda are supported")
    return "cpu"


def load_state_dict(ckpt_dir, device="cpu", names=None, dtype: str = "auto", direct: bool = False,
                    comm: Comm | None = None, map: str | None = None, hf_config=None,
                    **load_options) -> dict:
    """Every tensor (or those in `names`) of ckpt_dir as a dict of torch tensors on `device`.
    map and hf_config: as Checkpoint's (a native checkpoint under HF names)."""
    dev = _device_str(device)
    with Checkpoint(ckpt_dir, dtype=dtype, direct=direct, map=map, hf_config=hf_config) as ck:
        infos = ck.tensors if names is None else [ck.by_name[n] for n in names]
        out, reqs = {}, []
        for info in infos:
            t = _empty_for(info, dev)
            _advise_huge(t)
            out[info.name] = t
            reqs.append((info.name, t.data_ptr() if info.nbytes else None, info.nbytes))
        ck.load(reqs, device=dev, comm=comm, **load_options)
    return out


def load_into(model, ckpt_dir, strict: bool = True, dtype: str = "auto", direct: bool = False,
              map: str | None = None, hf_config=None, **load_options):
    """Fills model's parameters and buffers in place from ckpt_dir (on the model's device).

    A tensor whose dtype differs from the checkpoint's is loaded into a temporary and copied
    (converted). With strict, names of the model missing from the checkpoint (other than tied
    copies of loaded storage) or the reverse raise; returns (missing, unexpected) otherwise.
    A tensor whose shape differs from the checkpoint's always raises LoadError naming it.
    """
    with Checkpoint(ckpt_dir, dtype=dtype, direct=direct, map=map, hf_config=hf_config) as ck:
        return _load_into(model, ck, strict, load_options)[:2]


def _load_into(model, ck: Checkpoint, strict: bool, load_options: dict):
    """load_into on an open checkpoint: (missing, unexpected, names of the loaded tensors,
    tied copies of loaded storage included)."""
    import torch
    sd = model.state_dict(keep_vars=True)
    loaded_ptrs, reqs, converts, missing = set(), {}, [], []
    for name, t in sd.items():
        t = t.data if isinstance(t, torch.nn.Parameter) else t
        info = ck.by_name.get(name)
        if info is None:
            missing.append(name)
            continue
        if tuple(t.shape) != info.shape:
            raise LoadError(22, f"tensor '{name}': the model has shape {tuple(t.shape)}, "
                                f"{ck.path} has {info.shape}")
        if t.data_ptr() in loaded_ptrs and t.numel():
            continue  # tied: the same storage is already being loaded
        loaded_ptrs.add(t.data_ptr())
        dev = _device_str(t.device)
        if _torch_dtype(info.dtype) == t.dtype and t.is_contiguous():
            reqs.setdefault(dev, []).append((name, t.data_ptr() if info.nbytes else None,
                                             info.nbytes))
        else:
            tmp = _empty_for(info, dev)
            reqs.setdefault(dev, []).append((name, tmp.data_ptr() if info.nbytes else None,
                                             info.nbytes))
            converts.append((t, tmp))
    missing = [n for n in missing if sd[n].data_ptr() not in loaded_ptrs or not sd[n].numel()]
    unexpected = [n for n in ck.by_name if n not in sd]
    if strict and (missing or unexpected):
        raise LoadError(22, f"{ck.path}: missing from the checkpoint: {missing}; "
                            f"not in the model: {unexpected}")
    with torch.no_grad():
        for dev, rs in reqs.items():
            ck.load(rs, device=dev, **load_options)
        for t, tmp in converts:
            t.copy_(tmp.view(t.shape) if tmp.dtype != torch.uint8 else tmp)
    missing_set = set(missing)
    return missing, unexpected, [n for n in sd if n not in missing_set]


def _auto_dtype(config, ck: Checkpoint):
    """transformers' dtype="auto": config.dtype, else the checkpoint's first floating dtype
    (fp8/fp4 skipped), else its first tensor's, else float32."""
    import torch
    dt = getattr(config, "dtype", None)
    if dt is not None:
        return getattr(torch, dt) if isinstance(dt, str) else dt
    for info in ck.tensors:
        t = _torch_dtype(info.dtype)
        if t is not None and t.is_floating_point and "float8" not in str(t):
            return t
    t = _torch_dtype(ck.tensors[0].dtype) if ck.tensors else None
    return t if t is not None else torch.float32


def from_pretrained(ckpt_dir, model_cls=None, config=None, device="cpu", dtype="auto",
                    strict: bool = True, map: str | None = None, hf_config=None,
                    direct: bool = False, **load_options):
    """A transformers model loaded from ckpt_dir (rank shards or consolidated safetensors)
    without a mount: the model that `AutoModelForCausalLM.from_pretrained(consolidated dir,
    dtype=dtype)` gives, built on the meta device and filled by the C++ loader in place.

        model = ckptfs_load.from_pretrained("/ckpt/step_100/model")             # CPU
        model = ckptfs_load.from_pretrained(src, device="cuda:0", dtype=torch.bfloat16)

    ckpt_dir: a checkpoint directory Checkpoint accepts. model_cls: a transformers model class
    (default AutoModelForCausalLM). config: a transformers config object, or the path of a
    config.json or of a directory holding one; default: ckpt_dir/config.json, else hf_config.
    device: "cpu" or "cuda:N". dtype: "auto" (config.dtype, else the checkpoint's first
    floating dtype, as transformers), a torch.dtype or its name; tensors stored in another
    dtype are converted as from_pretrained converts them. strict: a name of the model missing
    from the checkpoint, or the reverse, raises LoadError (with strict=False, missing
    tensors are initialised the way from_pretrained initialises them, and unexpected ones are
    ignored). map, hf_config, direct: as Checkpoint's. load_options: Checkpoint.load's
    (threads, chunk_mb, ring, ...).

    After loading, the same finishing steps as from_pretrained: tied weights share one
    storage (tie_weights), non-persistent buffers (RoPE inv_freq, ...) are computed by the
    model's own _init_weights, _keep_in_fp32_modules_strict modules are float32,
    generation_config.json is read when present, and the model is in eval() mode. Weight
    renamings and conversions that from_pretrained applies to legacy checkpoints (fused MoE
    experts, old key names) are not: such names fail strict loading, naming the tensors.
    Needs transformers (imported here only).
    """
    import copy
    import re

    import torch
    import transformers

    ckpt_dir = os.fspath(ckpt_dir)
    if config is None or isinstance(config, (str, os.PathLike)):
        where = config
        if where is None:
            where = ckpt_dir if os.path.exists(os.path.join(ckpt_dir, "config.json")) else hf_config
        if where is None:
            raise LoadError(2, f"{ckpt_dir}: no config.json (give config= or hf_config=)")
        where = os.fspath(where)
        config = transformers.AutoConfig.from_pretrained(
            os.path.dirname(where) if os.path.isfile(where) else where)
    else:
        config = copy.deepcopy(config)  # as from_pretrained: the caller's config is not changed
    dev = _device_str(device)
    with Checkpoint(ckpt_dir, direct=direct, map=map, hf_config=hf_config) as ck:
        if isinstance(dtype, str):
            dtype = _auto_dtype(config, ck) if dtype == "auto" else getattr(torch, dtype)
        config.name_or_path = ckpt_dir
        cls = model_cls or transformers.AutoModelForCausalLM
        build = cls.from_config if hasattr(cls, "from_config") else cls._from_config
        with torch.device("meta"):
            model = build(config, dtype=dtype)
        # _keep_in_fp32_modules_strict: float32 whatever dtype, as from_pretrained's dtype plan.
        plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
        for name, p in model.named_parameters() if plan else ():
            for pattern, pdt in plan.items():
                if re.search(pattern.replace("*", ".*"), name):
                    p.data = p.data.to(pdt)
                    break
        model.to_empty(device=dev)
        for t in list(model.parameters()) + list(model.buffers()):
            _advise_huge(t)  # fresh memory: 2 MiB pages make the loader's first touch cheap
        model.tie_weights()  # to_empty gave each tied name its own storage: one again
        _, _, loaded = _load_into(model, ck, strict, load_options)
    # What was loaded is marked initialised; the model's own init then computes the rest
    # (non-persistent buffers such as RoPE's inv_freq, and anything missing with strict=False),
    # the way from_pretrained finishes a model.
    sd = model.state_dict(keep_vars=True)
    for name in loaded:
        sd[name]._is_hf_initialized = True
    if hasattr(model, "initialize_weights"):
        model.initialize_weights()
    model.eval()
    gen = os.path.join(ckpt_dir, "generation_config.json")
    if getattr(model, "can_generate", lambda: False)() and os.path.exists(gen):
        model.generation_config = transformers.GenerationConfig.from_pretrained(ckpt_dir)
    return model
