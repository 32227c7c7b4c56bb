#!/usr/bin/env python3
"""The Python side of ckpt_export_test: reads and writes the files `loom ckpt export|import`
exchange with PyTorch, using only torch (torch.load, torch.save) and a small safetensors reader
and writer written here from the format's description (Debian packages no safetensors).

  tensor_files.py dump-torch FILE OUT.json         torch.load(FILE): name -> dtype, shape, bytes
  tensor_files.py dump-safetensors FILE OUT.json   the same for a safetensors file
  tensor_files.py save-torch FILE OUT.json         torch.save(a module's state_dict() + extras)
  tensor_files.py save-safetensors FILE OUT.json   the same tensors as safetensors
  tensor_files.py save-hostile-torch DIR OUT.json  torch.save-like files Loom must refuse
  tensor_files.py resave-torch FILE OUT.json       torch.load(FILE), then torch.save of that
                                                   state_dict to FILE.python.pt, and dump it

OUT.json: {"tensors": {name: {"dtype", "shape", "hex"}}, "metadata": {...}, "input_hex",
"output_hex"}: for save-*, the module's output on a fixed input, to compare with Loom's.
"""
import collections
import io
import json
import os
import pickle
import struct
import sys
import zipfile

import torch

CODES = {
    torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def raw_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def describe(t):
    return {"dtype": CODES[t.dtype], "shape": list(t.shape), "hex": raw_bytes(t).hex()}


def read_safetensors(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    base = 8 + n
    tensors = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        tensors[name] = {"dtype": e["dtype"], "shape": e["shape"],
                         "hex": data[base + begin:base + end].hex()}
    return tensors, metadata


def write_safetensors(path, tensors):
    """Sorted by name, as the reference writer orders tensors of one dtype width."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        b = raw_bytes(tensors[name])
        header[name] = {"dtype": CODES[tensors[name].dtype], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    header["__metadata__"] = {"format": "pt", "written_by": "tensor_files.py"}
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def model_and_extras():
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    state = model.state_dict()  # an OrderedDict with _metadata, as users save it
    state["extra.bf16"] = torch.randn(5).to(torch.bfloat16)
    state["extra.f16"] = torch.randn(2, 3).to(torch.float16)
    state["extra.i64"] = torch.tensor([1, -2, 3 << 40])
    state["extra.i32"] = torch.tensor([7, -8], dtype=torch.int32)
    state["extra.u8"] = torch.tensor([0, 200, 255], dtype=torch.uint8)
    state["extra.mask"] = torch.tensor([[True, False], [False, True]])
    state["extra.f64"] = torch.tensor([1.0 / 3.0], dtype=torch.float64)
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 10
    with torch.no_grad():
        y = model(x)
    return state, x, y


class FakeStorage:
    """A storage reference for a hand-made pickle: ('storage', torch.FloatStorage, key, ...)."""

    def __init__(self, key, numel):
        self.key, self.numel = key, numel


class FakeTensor:
    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def hostile_archive(path, obj, records):
    """A zip laid out like torch.save's, with data.pkl pickling obj (protocol 2)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=2)
    pickler.persistent_id = lambda o: (
        ("storage", torch.FloatStorage, o.key, "cpu", o.numel)
        if isinstance(o, FakeStorage) else None)
    pickler.dump(obj)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buffer.getvalue())
        for key, data in records.items():
            z.writestr("archive/data/" + key, data)
        z.writestr("archive/version", "3\n")


def save_hostile(directory):
    """Each file and the words Loom's refusal must contain."""
    cases = {
        "storage_short.pt": ({"w": FakeTensor(FakeStorage("0", 100), 0, (100,), (1,))},
                             {"0": b"\0" * 8}, "fewer than its 100 elements"),
        "view_outside.pt": ({"w": FakeTensor(FakeStorage("0", 2), 0, (4,), (1,))},
                            {"0": b"\0" * 8}, "reaches outside its storage of 2 elements"),
        "missing_record.pt": ({"w": FakeTensor(FakeStorage("7", 2), 0, (2,), (1,))},
                              {"0": b"\0" * 8}, "no record data/7"),
        "callable.pt": ({"w": Evil()}, {}, "builds a posix.system"),
    }
    expected = {}
    for name, (obj, records, words) in cases.items():
        hostile_archive(os.path.join(directory, name), obj, records)
        expected[name] = words
    torch.save({"n": 1}, os.path.join(directory, "not_a_tensor.pt"))
    expected["not_a_tensor.pt"] = 'entry "n" is not a tensor'
    torch.save({"model": {"w": torch.ones(2)}}, os.path.join(directory, "nested.pt"))
    expected["nested.pt"] = 'entry "model" is not a tensor'
    torch.save([torch.ones(2)], os.path.join(directory, "list.pt"))
    expected["list.pt"] = "does not hold a dict"
    return expected


def main():
    command, path, out = sys.argv[1:4]
    record = {}
    if command == "dump-torch":
        loaded = torch.load(path)
        assert isinstance(loaded, dict), type(loaded)
        record["tensors"] = {k: describe(v) for k, v in loaded.items()}
        record["type"] = type(loaded).__name__
    elif command == "resave-torch":
        loaded = torch.load(path)
        state = collections.OrderedDict((k, v.clone()) for k, v in loaded.items())
        torch.save(state, path + ".python.pt")
        record["tensors"] = {k: describe(v) for k, v in state.items()}
    elif command == "dump-safetensors":
        record["tensors"], record["metadata"] = read_safetensors(path)
    elif command == "save-hostile-torch":
        record["expected"] = save_hostile(path)
    elif command in ("save-torch", "save-safetensors"):
        state, x, y = model_and_extras()
        if command == "save-torch":
            torch.save(state, path)
        else:
            write_safetensors(path, state)
        record["tensors"] = {k: describe(v) for k, v in state.items()}
        record["input_hex"] = raw_bytes(x).hex()
        record["output_hex"] = raw_bytes(y).hex()
    else:
        sys.exit(f"unknown command {command}")
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
