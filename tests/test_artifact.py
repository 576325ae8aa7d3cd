"""The .ninfer v3 format: round trip, streaming writer, validation on open, CRC verify."""

from __future__ import annotations

import json
import os
import struct
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ninfer_core.artifact import FORMAT_VERSION, Artifact, ArtifactError, TensorSpec, write_artifact


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(11, 6, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(5, 6, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(6, generator=g),  # f32
        "lm_head.weight": torch.randn(11, 6, generator=g).to(torch.float16),
        "mtp.fc.weight": torch.randn(3, 7, generator=g).to(torch.bfloat16),  # odd byte count
        "model.visual.patch_embed.proj.weight": torch.randn(2, 3, 2, generator=g),
        "buffers.position_ids": torch.arange(9, dtype=torch.int64),
        "buffers.i32": torch.tensor([-3, 4, 1 << 30], dtype=torch.int32),
        "buffers.i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "buffers.u8": torch.tensor([0, 255, 7], dtype=torch.uint8),
        "buffers.mask": torch.tensor([True, False, True]),
        "buffers.empty": torch.zeros(0, 4),
        "buffers.scalar": torch.tensor(2.5),
    }


def _manifest() -> dict:
    return {
        "name": "tiny-test",
        "architecture": "qwen3_5",
        "config": {"model_type": "qwen3_5", "text_config": {"hidden_size": 6, "layer_types": ["a", "b"]}},
        "tokenizer": {
            "type": "bpe",
            "ranks": "IQ== 0\nIg== 1\n",
            "pattern": r"\p{L}+|\s+",
            "added_tokens": [{"id": 2, "content": "<|im_end|>", "special": True}],
            "eos_tokens": ["<|im_end|>"],
            "pad_token": None,
            "bos_token": None,
        },
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %} \u00e9\u4e2d",
        "generation": {"temperature": 0.6, "top_p": 0.95},
    }


def _specs(tensors: dict[str, torch.Tensor], loads: list[str] | None = None) -> list[TensorSpec]:
    def loader(name: str, t: torch.Tensor):
        def load():
            if loads is not None:
                loads.append(name)
            return t.clone()

        return load

    return [TensorSpec(n, t.dtype, tuple(t.shape), loader(n, t)) for n, t in tensors.items()]


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "m.ninfer"
    tensors = _tensors()
    write_artifact(path, _manifest(), _specs(tensors))
    return str(path), tensors


def _header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def _write_raw_safetensors(path, metadata: dict | None, tensors=None) -> None:
    save_file(tensors or {"x": torch.zeros(2)}, str(path), metadata=metadata)


# round trip


def test_round_trip_tensors_and_manifest(written):
    path, tensors = written
    given = _manifest()
    with Artifact.open(path) as art:
        assert art.manifest["format_version"] == FORMAT_VERSION == 3
        assert art.name == "tiny-test"
        assert art.architecture == "qwen3_5"
        assert art.config == given["config"]
        assert art.tokenizer_section == given["tokenizer"]
        assert art.chat_template == given["chat_template"]
        assert art.manifest["generation"] == given["generation"]
        assert art.manifest["identity"] == {"model_id": "tiny-test"}
        assert art.components == ["text", "mtp", "vision"]
        assert sorted(art.tensor_names()) == sorted(tensors)
        for name, t in tensors.items():
            got = art.get_tensor(name)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(got, t), name
            assert art.has_tensor(name)
        assert not art.has_tensor("nope")
        with pytest.raises(ArtifactError, match="no tensor 'nope'"):
            art.get_tensor("nope")


def test_manifest_tensor_table_and_components(written):
    path, tensors = written
    art = Artifact.open(path)
    table = art.manifest["tensors"]
    assert set(table) == set(tensors)
    assert table["model.embed_tokens.weight"]["encoding"] == "bf16"
    assert table["model.norm.weight"]["encoding"] == "f32"
    assert table["lm_head.weight"]["encoding"] == "f16"
    assert table["buffers.position_ids"]["encoding"] == "i64"
    assert all(len(e["crc32"]) == 8 for e in table.values())
    assert art.tensor_names("mtp") == ["mtp.fc.weight"]
    assert art.tensor_names("vision") == ["model.visual.patch_embed.proj.weight"]
    assert "lm_head.weight" in art.tensor_names("text")
    assert art.tensor_component("mtp.fc.weight") == "mtp"
    assert art.num_parameters() == sum(t.numel() for t in tensors.values())


def test_tensors_are_aligned_to_their_element_size(written):
    path, tensors = written
    art = Artifact.open(path)
    for name, t in tensors.items():
        offset, nbytes = art.tensor_file_range(name)
        assert offset % t.element_size() == 0, name
        assert nbytes == t.numel() * t.element_size()
    assert art.tensor_file_range("model.embed_tokens.weight")[0] % 8 == 0


def test_readable_by_the_safetensors_library(written):
    path, tensors = written
    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        manifest = json.loads(f.metadata()["ninfer.manifest"])
        assert manifest["format_version"] == 3 and manifest["architecture"] == "qwen3_5"
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), tensors["model.embed_tokens.weight"])
    loaded = load_file(path)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t), name


def test_get_tensor_is_memory_mapped(written):
    path, _ = written
    art = Artifact.open(path)
    a = art.get_tensor("lm_head.weight")
    b = art.get_tensor("lm_head.weight")
    # Views into one mapping of the file, not fresh copies.
    assert a.data_ptr() == b.data_ptr()


def test_manifest_component_override_is_kept(tmp_path):
    t = torch.ones(2)
    m = {"architecture": "x", "tensors": {"draft.fc": {"component": "dflash"}}}
    write_artifact(tmp_path / "a.ninfer", m, [TensorSpec("draft.fc", t.dtype, (2,), lambda: t)])
    art = Artifact.open(tmp_path / "a.ninfer")
    assert art.components == ["dflash"]
    assert art.name == "a"  # defaults to the file name


# streaming writer


def test_writer_streams_one_tensor_at_a_time(tmp_path):
    path = tmp_path / "s.ninfer"
    tmp = str(path) + ".tmp"
    tensors = {f"w{i}": torch.full((64, 64), float(i)) for i in range(6)}
    loads: list[str] = []
    alive: list[weakref.ref] = []
    header_sizes: list[int] = []

    def make(name):
        def load():
            loads.append(name)
            # the header went out before any tensor was loaded, to the temporary file
            assert not path.exists()
            header_sizes.append(os.path.getsize(tmp))
            # every tensor loaded before has been written and dropped
            assert all(r() is None for r in alive), "writer kept an earlier tensor alive"
            t = tensors[name].clone()
            alive.append(weakref.ref(t))
            return t

        return load

    specs = [TensorSpec(n, t.dtype, tuple(t.shape), make(n)) for n, t in tensors.items()]
    write_artifact(path, {"architecture": "x"}, specs)
    assert loads == list(tensors)  # each loaded exactly once, in order
    # at each load the file held the full header plus exactly the tensors before it
    head = header_sizes[0]
    assert head > 8 and head % 8 == 0
    assert header_sizes == [head + i * 64 * 64 * 4 for i in range(6)]
    assert not os.path.exists(tmp)
    art = Artifact.open(path)
    for n, t in tensors.items():
        assert torch.equal(art.get_tensor(n), t)


def test_writer_removes_partial_file_and_keeps_old_one(tmp_path, written):
    path, _ = written
    before = open(path, "rb").read()

    def boom():
        raise RuntimeError("disk on fire")

    t = torch.ones(3)
    specs = [TensorSpec("a", t.dtype, (3,), lambda: t), TensorSpec("b", t.dtype, (3,), boom)]
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_artifact(path, {"architecture": "x"}, specs)
    assert not os.path.exists(path + ".tmp")
    assert open(path, "rb").read() == before


def test_writer_refuses_a_tensor_that_does_not_match_its_spec(tmp_path):
    t = torch.ones(3, 2)
    with pytest.raises(ArtifactError, match="spec says"):
        write_artifact(
            tmp_path / "a.ninfer", {"architecture": "x"}, [TensorSpec("a", t.dtype, (2, 3), lambda: t)]
        )
    with pytest.raises(ArtifactError, match="spec says"):
        write_artifact(
            tmp_path / "a.ninfer", {"architecture": "x"}, [TensorSpec("a", torch.bfloat16, (3, 2), lambda: t)]
        )
    assert not (tmp_path / "a.ninfer").exists() and not (tmp_path / "a.ninfer.tmp").exists()


def test_writer_refuses_bad_input(tmp_path):
    t = torch.ones(1)
    spec = TensorSpec("a", t.dtype, (1,), lambda: t)
    with pytest.raises(ArtifactError, match="given twice"):
        write_artifact(tmp_path / "a.ninfer", {"architecture": "x"}, [spec, spec])
    with pytest.raises(ArtifactError, match="architecture"):
        write_artifact(tmp_path / "a.ninfer", {}, [spec])
    with pytest.raises(ArtifactError, match="cannot be stored"):
        write_artifact(
            tmp_path / "a.ninfer", {"architecture": "x"}, [TensorSpec("c", torch.complex64, (1,), None)]
        )


def test_writer_progress_lines_when_not_a_terminal(tmp_path, capsys):
    t = torch.ones(1000)
    specs = [TensorSpec(f"t{i}", t.dtype, (1000,), lambda: t) for i in range(4)]
    write_artifact(tmp_path / "a.ninfer", {"architecture": "x"}, specs, progress=True)
    err = capsys.readouterr().err
    assert "writing: 100% (4/4 tensors" in err


# validation on open


def test_truncated_file_refused(written, tmp_path):
    path, _ = written
    data = open(path, "rb").read()
    n = _header_len(data)
    data_len = len(data) - 8 - n
    cut = tmp_path / "cut.ninfer"
    cut.write_bytes(data[:-5])
    with pytest.raises(ArtifactError) as e:
        Artifact.open(cut)
    assert str(e.value) == (
        f"artifact {cut} is truncated: header says {data_len} bytes of tensor data, file has {data_len - 5}"
    )
    cut.write_bytes(data[: 8 + n // 2])  # cut inside the header
    with pytest.raises(ArtifactError, match="truncated"):
        Artifact.open(cut)
    cut.write_bytes(data[:5])
    with pytest.raises(ArtifactError, match="not a safetensors file"):
        Artifact.open(cut)


def test_trailing_bytes_refused(written, tmp_path):
    path, _ = written
    bad = tmp_path / "long.ninfer"
    bad.write_bytes(open(path, "rb").read() + b"\0\0\0")
    with pytest.raises(ArtifactError, match="3 unexpected bytes at the end"):
        Artifact.open(bad)


def test_every_flipped_header_byte_refused(written, tmp_path):
    path, _ = written
    data = open(path, "rb").read()
    n = _header_len(data)
    bad = tmp_path / "flip.ninfer"
    accepted = []
    for i in range(8 + n):
        for bit in (0x01, 0x80):
            b = bytearray(data)
            b[i] ^= bit
            bad.write_bytes(b)
            try:
                Artifact.open(bad)
            except ArtifactError:
                continue
            accepted.append((i, bit))
    assert accepted == []


def test_flipped_header_byte_message(written, tmp_path):
    path, _ = written
    data = bytearray(open(path, "rb").read())
    i = data.index(b"qwen3_5")
    data[i] ^= 0x02  # 'q' -> 's': still valid JSON, caught by the header checksum
    bad = tmp_path / "flip.ninfer"
    bad.write_bytes(data)
    with pytest.raises(ArtifactError, match="corrupt header: CRC32"):
        Artifact.open(bad)


def test_not_a_safetensors_file_refused(tmp_path):
    p = tmp_path / "x.ninfer"
    p.write_bytes(b"hello, this is plainly a text file and nothing more\n" * 4)
    with pytest.raises(ArtifactError, match="not a safetensors file"):
        Artifact.open(p)
    p.write_bytes(struct.pack("<Q", 16) + b"[1, 2, 3]       ")
    with pytest.raises(ArtifactError, match="not a safetensors file"):
        Artifact.open(p)
    p.write_bytes(struct.pack("<Q", 16) + b'{"a": nope}     ')
    with pytest.raises(ArtifactError, match="corrupt header"):
        Artifact.open(p)
    with pytest.raises(ArtifactError, match="does not exist"):
        Artifact.open(tmp_path / "missing.ninfer")
    with pytest.raises(ArtifactError, match="is a directory"):
        Artifact.open(tmp_path)


def test_missing_manifest_refused(tmp_path):
    p = tmp_path / "plain.safetensors"
    _write_raw_safetensors(p, {"format": "pt"})
    with pytest.raises(ArtifactError, match=r"is not a \.ninfer artifact"):
        Artifact.open(p)
    _write_raw_safetensors(p, None)
    with pytest.raises(ArtifactError, match=r"is not a \.ninfer artifact"):
        Artifact.open(p)


def test_format_version_2_refused(tmp_path):
    p = tmp_path / "old.ninfer"
    manifest = {"format_version": 2, "architecture": "qwen3_5", "tensors": {"x": {"encoding": "f32"}}}
    _write_raw_safetensors(p, {"ninfer.manifest": json.dumps(manifest)})
    with pytest.raises(ArtifactError) as e:
        Artifact.open(p)
    want = "format version 2 is not supported; this build reads version 3, reconvert with ninfer convert"
    assert want in str(e.value)


def test_corrupt_manifest_json_refused(tmp_path):
    p = tmp_path / "m.ninfer"
    _write_raw_safetensors(p, {"ninfer.manifest": "{not json"})
    with pytest.raises(ArtifactError, match="corrupt manifest"):
        Artifact.open(p)


def _rewrite_header(src: str, dst, edit) -> None:
    """Re-serialise a written artifact's header after `edit(header)`, recomputing the checksum."""
    from ninfer_core.artifact.format import CRC_PLACEHOLDER, HEADER_CRC_KEY, crc32, crc_hex, header_crc_field

    data = open(src, "rb").read()
    n = _header_len(data)
    header = json.loads(data[8 : 8 + n])
    edit(header)
    header["__metadata__"][HEADER_CRC_KEY] = CRC_PLACEHOLDER
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    raw = raw.replace(header_crc_field(CRC_PLACEHOLDER), header_crc_field(crc_hex(crc32(raw))))
    with open(dst, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data[8 + n :])


def test_inconsistent_offsets_refused(written, tmp_path):
    path, _ = written
    bad = tmp_path / "bad.ninfer"
    _rewrite_header(path, bad, lambda h: None)
    Artifact.open(bad)  # the helper itself produces a valid file

    def overlap(h):
        a = h["model.norm.weight"]["data_offsets"]
        h["model.norm.weight"]["data_offsets"] = [a[0] - 4, a[1] - 4]

    _rewrite_header(path, bad, overlap)
    with pytest.raises(ArtifactError, match="inconsistent tensor offsets"):
        Artifact.open(bad)

    def wrong_size(h):
        h["lm_head.weight"]["shape"] = [11, 5]

    _rewrite_header(path, bad, wrong_size)
    with pytest.raises(ArtifactError, match="needs"):
        Artifact.open(bad)


def test_manifest_and_header_disagree_refused(written, tmp_path):
    path, _ = written
    bad = tmp_path / "bad.ninfer"

    def drop_from_manifest(h):
        m = json.loads(h["__metadata__"]["ninfer.manifest"])
        del m["tensors"]["lm_head.weight"]
        h["__metadata__"]["ninfer.manifest"] = json.dumps(m)

    _rewrite_header(path, bad, drop_from_manifest)
    with pytest.raises(ArtifactError, match="the manifest lacks"):
        Artifact.open(bad)

    def wrong_encoding(h):
        m = json.loads(h["__metadata__"]["ninfer.manifest"])
        m["tensors"]["lm_head.weight"]["encoding"] = "bf16"
        h["__metadata__"]["ninfer.manifest"] = json.dumps(m)

    _rewrite_header(path, bad, wrong_encoding)
    with pytest.raises(ArtifactError, match="manifest says encoding 'bf16'"):
        Artifact.open(bad)


# verify


def test_verify_passes_on_a_good_file(written):
    path, tensors = written
    assert Artifact.open(path).verify() == len(tensors)


def test_verify_catches_a_flipped_data_byte(written, tmp_path):
    path, _ = written
    art = Artifact.open(path)
    offset, nbytes = art.tensor_file_range("mtp.fc.weight")
    data = bytearray(open(path, "rb").read())
    data[offset + nbytes // 2] ^= 0x10
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(data)
    art = Artifact.open(bad)  # open does not read the data
    with pytest.raises(ArtifactError, match=r"CRC32 mismatch in 1 tensor\(s\): 'mtp.fc.weight'"):
        art.verify()
