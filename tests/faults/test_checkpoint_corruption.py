"""Fault injection into replay checkpoints: bit flips, truncation, swapped and missing files, re-signed
inconsistent content. Every damaged checkpoint is refused with an error naming the directory (and the
file, for a checksum mismatch) or loads exactly the saved state; none loads a different state.

Regression (hardening issue, "replay data that survives"): before checksums, 6 of 37 single-bit
flips inside array data loaded silently as a different table.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from reactor.replay import (
    CheckpointCorruptError,
    FieldSpec,
    Fifo,
    Prioritized,
    SampleToInsertRatio,
    Storage,
    Table,
    WindowRead,
)
from reactor.replay.checkpoint import FORMAT, MANIFEST, MARKER, read_checkpoint

from ._state import bitwise_equal

SPECS = [FieldSpec("obs", (3,), torch.float32), FieldSpec("done", (), torch.bool),
         FieldSpec("half", (2,), torch.bfloat16)]


def make() -> Table:
    # max_size < capacity: the remover is fed, so its state is in the checkpoint too
    return Table(Storage(SPECS, 64), sampler=Prioritized(0.7), remover=Fifo(), max_size=48,
                 rate_limiter=SampleToInsertRatio(2.0, 5, (-1e9, 1e9)), read=WindowRead(4), beta=0.6, seed=3)


def fill(t: Table, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for i in range(0, n, 5):
        t.insert_nowait({"obs": torch.from_numpy(rng.normal(size=(5, 3)).astype(np.float32)),
                         "done": torch.from_numpy(rng.random(5) < 0.5),
                         "half": torch.from_numpy(rng.normal(size=(5, 2))).to(torch.bfloat16)},
                        rng.uniform(0.1, 3.0, 5), episode_end=bool(i % 10))
    _, info = t.sample_nowait(6)
    t.update_priorities(info.keys, np.linspace(0.5, 2.0, 6))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two checkpoints of one table (A, then B after more work) and the state each holds."""
    root = tmp_path_factory.mktemp("ckpt")
    t = make()
    fill(t, 60, 0)
    a = t.save(root, keep=10)
    state_a = t.state_dict()
    fill(t, 20, 1)
    b = t.save(root, keep=10)
    state_b = t.state_dict()
    return {"a": a, "b": b, "state_a": state_a, "state_b": state_b}


def _copy(src: Path, dst_root: Path) -> Path:
    dst = dst_root / src.name  # the same ckpt-N name: the manifest names its own directory
    shutil.copytree(src, dst)
    return dst


def _loads_identical_or_refused(path: Path, state: dict, file: str | None) -> str:
    """'refused' (the error names the directory, and ``file`` when given) or 'identical'; fails otherwise."""
    try:
        t = Table.load(path)
    except CheckpointCorruptError as e:
        msg = str(e)
        assert msg.startswith(f"checkpoint {str(path)!r}: "), msg
        assert msg.endswith("the checkpoint is refused"), msg
        if file is not None:
            assert file in msg, msg
        return "refused"
    assert bitwise_equal(t.state_dict(), state), f"{path} loaded a state that differs from the saved one"
    return "identical"


def _files(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir())


def test_every_file_is_covered_by_a_checksum(saved):
    manifest = json.loads((saved["a"] / MANIFEST).read_text())
    npy = {p for p in _files(saved["a"]) if p.endswith(".npy")}
    assert set(manifest["checksums"]) == npy and len(npy) >= 10
    marker = (saved["a"] / MARKER).read_text().split("\n")
    assert marker[0] == FORMAT and marker[1].startswith(f"{MANIFEST} blake2b-256:")


def test_an_intact_checkpoint_loads_the_saved_state_bit_for_bit(saved):
    assert bitwise_equal(Table.load(saved["a"]).state_dict(), saved["state_a"])
    assert bitwise_equal(Table.load(saved["b"]).state_dict(), saved["state_b"])


def test_single_bit_flips_anywhere_in_any_file_are_refused(saved, tmp_path):
    """12 seeded bit positions per file (always its first and last bit), every file of the checkpoint."""
    rng = np.random.default_rng(2024)
    outcomes = {}
    for name in _files(saved["a"]):
        size = (saved["a"] / name).stat().st_size
        bits = {0, size * 8 - 1} | {int(b) for b in rng.integers(0, size * 8, 10)}
        for bit in sorted(bits):
            where = _copy(saved["a"], tmp_path / f"{name}-{bit}")
            data = bytearray((where / name).read_bytes())
            data[bit // 8] ^= 1 << (bit % 8)
            (where / name).write_bytes(bytes(data))
            file = MARKER if name == MARKER else name
            outcomes[(name, bit)] = _loads_identical_or_refused(where, saved["state_a"], file)
    assert len(outcomes) > 100
    assert set(outcomes.values()) == {"refused"}  # a checksum catches every single-bit flip


@pytest.mark.parametrize("cut", ["empty", "half", "one-byte-short", "one-byte-long"])
def test_truncated_or_extended_files_are_refused(saved, tmp_path, cut):
    for name in _files(saved["a"]):
        where = _copy(saved["a"], tmp_path / name)
        data = (where / name).read_bytes()
        data = {"empty": b"", "half": data[: len(data) // 2], "one-byte-short": data[:-1],
                "one-byte-long": data + b"\0"}[cut]
        (where / name).write_bytes(data)
        assert _loads_identical_or_refused(where, saved["state_a"], None) == "refused", name


def test_files_swapped_in_from_another_checkpoint_are_refused_or_identical(saved, tmp_path):
    outcomes = {}
    for name in _files(saved["a"]):
        where = _copy(saved["a"], tmp_path / name)
        shutil.copyfile(saved["b"] / name, where / name)
        same = (saved["a"] / name).read_bytes() == (saved["b"] / name).read_bytes()
        outcomes[name] = _loads_identical_or_refused(where, saved["state_a"], None if same else name)
        if not same:
            assert outcomes[name] == "refused", name
    assert "refused" in outcomes.values()


def test_a_manifest_and_marker_moved_together_are_refused(saved, tmp_path):
    """The manifest names its own directory: B's manifest and marker in A's directory do not verify."""
    where = _copy(saved["a"], tmp_path)
    for name in (MANIFEST, MARKER):
        shutil.copyfile(saved["b"] / name, where / name)
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json belongs to 'ckpt-00000002', not to this directory"):
        Table.load(where)


def test_a_whole_checkpoint_renamed_to_another_number_is_refused(saved, tmp_path):
    where = tmp_path / saved["a"].name
    shutil.copytree(saved["b"], where)
    with pytest.raises(CheckpointCorruptError, match=r"belongs to 'ckpt-00000002'"):
        Table.load(where)


def test_a_missing_array_file_is_refused_naming_it(saved, tmp_path):
    where = _copy(saved["a"], tmp_path)
    (where / "table.keys.npy").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"table\.keys\.npy cannot be read"):
        Table.load(where)


def test_a_manifest_entry_removed_by_hand_is_refused(saved, tmp_path):
    where = _copy(saved["a"], tmp_path)
    doc = json.loads((where / MANIFEST).read_text())
    del doc["arrays"]["table.times_sampled"]
    (where / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True))
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json has checksum blake2b-256:[0-9a-f]{64}, "
                       r"COMPLETE says blake2b-256:[0-9a-f]{64}; the checkpoint is refused$"):
        Table.load(where)


# ------------------------------------------------------------------ re-signed content: the invariants

def _resign(where: Path, edit_manifest=None, arrays: dict | None = None) -> None:
    """Change a checkpoint and recompute its checksums, as a buggy writer would: only the content checks
    stand between it and the loader."""
    doc = json.loads((where / MANIFEST).read_text())
    if edit_manifest is not None:
        edit_manifest(doc)
    for name, arr in (arrays or {}).items():
        np.save(where / f"{name}.npy", arr, allow_pickle=False)
    for fname in list(doc["checksums"]):
        if (where / fname).is_file():
            doc["checksums"][fname] = "blake2b-256:" + hashlib.blake2b((where / fname).read_bytes(),
                                                                       digest_size=32).hexdigest()
    body = json.dumps(doc, indent=1, sort_keys=True).encode()
    (where / MANIFEST).write_bytes(body)
    digest = hashlib.blake2b(body, digest_size=32).hexdigest()
    (where / MARKER).write_text(f"{FORMAT}\n{MANIFEST} blake2b-256:{digest}\n")


def _drop_entry(doc):
    fname = doc["arrays"].pop("table.times_sampled")
    del doc["checksums"][fname]


def _arr(saved, name):
    return read_checkpoint(saved["a"])[1][name].copy()


CASES = {
    "missing-entry": (lambda s: (_drop_entry, None), r"KeyError: 'table\.times_sampled'"),
    "checksum-missing": (lambda s: (lambda d: d["checksums"].pop("table.keys.npy"), None),
                         r"manifest\.json lists array files .* but checksums for"),
    "duplicate-key": (lambda s: (None, {"table.keys": np.r_[_arr(s, "table.keys")[:1], _arr(s, "table.keys")[:-1]]}),
                      r"state keys must be distinct stored steps in \[\d+, \d+\), in increasing order"),
    "key-outside-ring": (lambda s: (None, {"table.keys": _arr(s, "table.keys") + 1000}),
                         r"state keys must be distinct stored steps"),
    "episode-gap": (lambda s: (None, {"storage.ep_len": _arr(s, "storage.ep_len") + np.eye(1, len(_arr(s, "storage.ep_len")), 0, dtype=np.int64)[0]}),
                    r"episode index does not tile the stored steps"),
    "presence-bit": (lambda s: (None, {"sampler.present": ~_arr(s, "sampler.present")}),
                     r"(has a priority but is not present|not exactly the table's)"),
    "count": (lambda s: (lambda d: d["counts"].__setitem__("inserted", d["counts"]["inserted"] + 1), None),
              r"state counts say \d+ inserted and \d+ gone, but it holds \d+ items"),
    "field-bytes": (lambda s: (None, {"field.obs": _arr(s, "field.obs")[:-4]}),
                    r"field\.obs\.npy holds uint8 \(\d+,\), the manifest's storage needs uint8 \(\d+,\)"),
    "priority-sum": (lambda s: (None, {"sampler.leaves": np.where(_arr(s, "sampler.present"), 1.7e308, 0.0)}),
                     r"the leaves sum to inf"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resigned_inconsistent_content_is_refused_with_a_clear_error(saved, tmp_path, case):
    make_edit, message = CASES[case]
    edit, arrays = make_edit(saved)
    where = _copy(saved["a"], tmp_path)
    _resign(where, edit, arrays)
    with pytest.raises(CheckpointCorruptError, match=rf"^checkpoint '{re.escape(str(where))}': .*{message}"):
        Table.load(where)


# ------------------------------------------------------------------ falling back

def test_restore_falls_back_to_the_previous_checkpoint_and_then_to_nothing(saved, tmp_path):
    root = tmp_path / "root"
    for ckpt in (saved["a"], saved["b"]):
        shutil.copytree(ckpt, root / ckpt.name)
    data = bytearray((root / saved["b"].name / "field.obs.npy").read_bytes())
    data[-1] ^= 0x10
    (root / saved["b"].name / "field.obs.npy").write_bytes(bytes(data))
    t, path, refusals = Table.restore(root)
    assert path == root / saved["a"].name and bitwise_equal(t.state_dict(), saved["state_a"])
    assert len(refusals) == 1 and "field.obs.npy has checksum" in refusals[0]
    (root / saved["a"].name / MANIFEST).write_text("{}")
    t, path, refusals = Table.restore(root)
    assert t is None and path is None and len(refusals) == 2
