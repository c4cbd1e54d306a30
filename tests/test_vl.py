"""Vision-language SFT (issue 56): the tiny LLaVA (``model = "tiny-vl"``) on the demo's coloured squares
(examples/data/vl_demo.jsonl, its images relative to the data file).

- a sample: labels on the assistant's tokens only, every image token -100; images brought within the pixel bounds; a
  record whose max_length cut would fall into an image is refused naming its line;
- DPO pairs: a pair whose cut at max_length would fall into its prompt's image is refused before the first step; TRL's
  cut keeps the prompt's images;
- packing: a packed row gives each sample the logits it gets alone, its images in row order; the rows are packed from
  each record's length counted ahead, and a model whose positions are per sequence trains padded batches, the reason
  in the log; a task that does not train images refused;
  LoRA adapts the language model's projections only, never the vision tower's;
- one-process runs (tests/one_process_runs.py: real DeepSpeed ZeRO-2 on the CPU): LoRA trains, the loss falls; full
  fine-tuning with ``freeze_projector = false`` trains the projector and the language model, never the vision tower;
- export: the LoRA run merged loads with ``AutoModelForImageTextToText`` and ``AutoProcessor``, equals base + adapter
  (peft's loading) on a batch with an image, and generates from an image;
- on the test cluster: 2 nodes, ZeRO-2, stopped by the walltime signal, requeued, resumed to the uninterrupted run's
  losses bitwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data" / "vl_demo.jsonl"
RED = ROOT / "examples" / "data" / "vl_images" / "red.png"
LORA, FULL = "vl_lora", "vl_full"


def vl_spec(**train):
    from swiftslurm.spec import parse_spec

    keys = {"model": "tiny-vl", "dataset": [str(DATA)], "image_max_pixels": 3136, "max_length": 128, **train}
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items())
    return parse_spec(f'[job]\nname = "vl"\noutput_dir = "/tmp/vl-unused"\n[train]\n{body}\n')


@pytest.fixture(scope="module")
def processor():
    from swiftslurm.train.tinymodel import build_processing

    return build_processing("tiny-vl")


def test_a_sample_is_trained_on_the_answer_only_with_its_images_tokens_masked(processor):
    from swiftslurm.train.data.vision import vision_data

    dataset, collate = vision_data(vl_spec(packing=False), processor)
    tok, image = processor.tokenizer, processor.tokenizer.convert_tokens_to_ids("<image>")
    two = dataset[12]  # "<image> then <image>: which colours?" -> "red, then green."
    assert tok.decode([t for t, lab in zip(two["input_ids"], two["labels"], strict=True) if lab != -100]) == "red, then green.</s>\n"
    assert sum(t == image for t in two["input_ids"]) == 8 and tuple(two["pixel_values"].shape) == (2, 3, 28, 28)
    assert all(lab == -100 for t, lab in zip(two["input_ids"], two["labels"], strict=True) if t == image)
    batch = collate([dataset[0], two, dataset[18]])  # one image, two, none (a text-only record)
    assert tuple(batch["pixel_values"].shape) == (3, 3, 28, 28)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (3, len(two["input_ids"]))
    assert int(batch["attention_mask"][0].sum()) == len(dataset[0]["input_ids"])


def test_a_packed_row_gives_each_sample_the_logits_it_gets_alone_with_its_images_in_row_order(processor):
    """Three samples (one image, two images, none) in rows of 256 tokens, against each sample alone in a padded batch:
    the same logits at every token, so no sample attends to another or takes another's image features."""
    import torch

    from swiftslurm.train.data.vision import vision_data
    from swiftslurm.train.tinymodel import build_model

    model = build_model(len(processor.tokenizer), 256, 42, name="tiny-vl").eval()
    rows, pack = vision_data(vl_spec(max_length=256), processor, model)
    alone, pad = vision_data(vl_spec(max_length=256, packing=False), processor)
    picked = [0, 12, 18]
    assert [len(alone[i].get("pixel_values", ())) for i in picked] == [1, 2, 0]
    batch = pack([[rows.samples[i] for i in picked]])
    assert tuple(batch["pixel_values"].shape) == (3, 3, 28, 28) and "attention_mask" not in batch
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], pixel_values=batch["pixel_values"]).logits[0]
        at = 0
        for i in picked:
            one = pad([alone[i]])
            n = one["input_ids"].shape[1]
            assert batch["input_ids"][0, at:at + n].equal(one["input_ids"][0])
            by_itself = model(**one).logits[0]
            assert (packed[at:at + n] - by_itself).abs().max().item() < 1e-5, i
            at += n


def tiny_qwen(family: str):
    """A 2-layer Qwen2-VL or Qwen2.5-VL built from a config (its processor needs torchvision, which cannot load here):
    images are 14 x 14-pixel patches, 2 x 2 merged into one token, with 3-D rotary positions (mrope)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=300, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2)
    vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_5_vl":
        config, cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])
    else:
        config, cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    torch.manual_seed(0)
    return cls(config(text_config=text, vision_config=vision, image_token_id=290, video_token_id=291,
                      vision_start_token_id=292, vision_end_token_id=293)).eval()


def qwen_sample(seed: int, before: int, grids: list[list[int]], after: int) -> dict:
    """A sample as VisionDataset gives it for Qwen2-VL: text, then per image <|vision_start|>, its t*h*w/4 image
    tokens, <|vision_end|> and some text; its pixel rows (3 x 2 x 14 x 14 values a patch) and image_grid_thw."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids, pixels = torch.randint(3, 280, (before,), generator=g).tolist(), []
    for t, h, w in grids:
        ids += [292] + [290] * (t * h * w // 4) + [293] + torch.randint(3, 280, (3,), generator=g).tolist()
        pixels.append(torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=g))
    ids += torch.randint(3, 280, (after,), generator=g).tolist()
    sample: dict = {"input_ids": ids, "labels": ids}
    if grids:
        sample.update(pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor(grids))
    return sample


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_a_packed_qwen2_vl_row_gives_each_sample_the_logits_its_own_3d_positions_give(family):
    """Qwen2-VL's rotary positions run over an image's grid (temporal, height, width): a packed row carries each
    sample's own (the model's get_rope_index, per sample) after the text positions; the same logits as each sample
    alone, where the model computes its positions itself."""
    import torch

    from swiftslurm.train.data.packing import prepare_model
    from swiftslurm.train.data.vision import VisionPackingCollator, rope_index

    model = tiny_qwen(family)
    prepare_model(model)  # no KV cache, as vision_data leaves a model that trains packed rows
    samples = [qwen_sample(1, 5, [[1, 4, 4]], 7), qwen_sample(2, 3, [], 6), qwen_sample(3, 2, [[1, 4, 8], [1, 4, 4]], 4)]
    rope = rope_index(model, 290)
    assert rope is not None and rope_index(build_llava(), 4) is None
    for flatten in (False, True):  # a flash kernel reads one flattened row
        batch = VisionPackingCollator(64, 0, flatten=flatten, rope=rope)([samples[:2], samples[2:]])
        assert batch["position_ids"].shape == ((4, 1, 128) if flatten else (4, 2, 64)) and "attention_mask" not in batch
        with torch.no_grad():
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], pixel_values=batch["pixel_values"],
                           image_grid_thw=batch["image_grid_thw"]).logits.reshape(-1, 300)
            starts = [0, 21, 64]  # row 1: samples 0 and 1 (21 + 9 tokens), row 2: sample 2
            for start, ex in zip(starts, samples, strict=True):
                ids = torch.tensor([ex["input_ids"]])
                alone = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=ex.get("pixel_values"),
                              image_grid_thw=ex.get("image_grid_thw"), mm_token_type_ids=(ids == 290).int()).logits[0]
                assert (packed[start:start + len(alone)] - alone).abs().max().item() < 1e-5, (family, flatten, start)


def build_llava():
    from swiftslurm.train.tinymodel import build_model

    return build_model(300, 128, 0, name="tiny-vl")


def test_the_rows_are_packed_from_each_records_length_counted_ahead_of_decoding_its_images(processor):
    from swiftslurm.train.data.packing import REAL_TOKENS
    from swiftslurm.train.data.records import DataError
    from swiftslurm.train.data.vision import vision_data

    rows, pack = vision_data(vl_spec(), processor)  # max_length 128: 19 records, 4 tokens an image
    assert rows.samples.counted == [len(rows.samples[i]["input_ids"]) for i in range(len(rows.samples))]
    assert sorted(j for r in range(len(rows)) for j in rows.row(r)) == list(range(19)) and len(rows) < 19
    batch = pack([rows[r] for r in range(len(rows))])
    assert batch["input_ids"].shape == (len(rows), 128) and int(batch[REAL_TOKENS].sum()) == sum(rows.samples.counted)
    images = sum(len(rows.samples[j].get("pixel_values", ())) for r in range(len(rows)) for j in rows.row(r))
    assert len(batch["pixel_values"]) == images == 24
    rows.samples.counted[0] += 1  # a processor that disagrees with its own count: refused, never an overflowing row
    with pytest.raises(DataError, match=r"vl_demo\.jsonl, line 1: the processor gave \d+ tokens where its count said \d+"):
        rows.samples[0]


def test_the_counts_are_made_once_and_read_back_by_the_other_ranks_and_every_requeue(tmp_path, processor, monkeypatch):
    from swiftslurm.train.data.vision import VisionDataset, vision_data

    data = tmp_path / "d.jsonl"
    data.write_text(DATA.read_text().replace('"vl_images/', f'"{DATA.parent}/vl_images/'))  # the images stay where they are
    counts = tmp_path / "out" / ".swiftslurm-cache" / "vl-lengths"
    rows, _ = vision_data(vl_spec(dataset=[str(data)]), processor, counts_dir=counts)
    (written,) = counts.glob("*.i32")
    assert written.stat().st_size == 4 * 19 and rows.samples.counted == [len(rows.samples[i]["input_ids"]) for i in range(19)]

    def no_count(*a, **k):
        raise AssertionError("counted again")

    with monkeypatch.context() as m:  # a second rank, or the run requeued: read, not counted
        m.setattr(VisionDataset, "_expanded", no_count)
        again, _ = vision_data(vl_spec(dataset=[str(data)]), processor, counts_dir=counts)
        assert again.samples.counted == rows.samples.counted and again.row(0) == rows.row(0)
    real = written.read_bytes()
    written.write_bytes(b"\x00" * 4 * 19)  # not one count a record (0 tokens): counted again and replaced
    vision_data(vl_spec(dataset=[str(data)]), processor, counts_dir=counts)
    assert written.read_bytes() == real
    elsewhere = tmp_path / "elsewhere.i32"  # a link under the name, to counts that would fit: not read, not written
    elsewhere.write_bytes((b"\x01" + b"\x00" * 3) * 19)
    written.unlink()
    written.symlink_to(elsewhere)
    linked, _ = vision_data(vl_spec(dataset=[str(data)]), processor, counts_dir=counts)
    assert linked.samples.counted == rows.samples.counted and not written.is_symlink() and written.read_bytes() == real
    assert elsewhere.read_bytes() == (b"\x01" + b"\x00" * 3) * 19
    with data.open("a") as f:  # another dataset: another key, its own counts
        f.write(data.read_text().splitlines()[0] + "\n")
    twenty, _ = vision_data(vl_spec(dataset=[str(data)]), processor, counts_dir=counts)
    assert len(twenty.samples.counted) == 20 and len(list(counts.glob("*.i32"))) == 2


def test_images_are_brought_within_the_pixel_bounds_before_the_processor():
    from swiftslurm.train.data.vision import within_bounds

    assert within_bounds(40, 40, 784, 3136) is None  # inside: as it is
    for size in ((120, 90), (60, 10)):  # over image_max_pixels, under image_min_pixels: scaled, the long side kept long
        w, h = within_bounds(*size, 784, 3136)
        assert 784 <= w * h <= 3136 and w > h, (size, w, h)


def test_a_cut_into_an_images_tokens_is_refused_naming_the_record(tmp_path, processor):
    from swiftslurm.train.data.records import DataError
    from swiftslurm.train.data.vision import vision_data

    data = tmp_path / "long.jsonl"
    ask = lambda text: [{"role": "user", "content": "x" * 140 + text}, {"role": "assistant", "content": "red"}]  # noqa: E731
    data.write_text(json.dumps({"messages": ask("")}) + "\n" + json.dumps({"messages": ask("<image>"), "images": [str(RED)]}) + "\n")
    for packing in (True, False):  # packed rows count every record ahead; padded batches scan them
        with pytest.raises(DataError, match=r"long\.jsonl, line 2: 1\d\d tokens with its images, .*would cut into an image's 4"):
            vision_data(vl_spec(dataset=[str(data)], packing=packing), processor)  # at start-up, before the first step
    dataset, _ = vision_data(vl_spec(dataset=[str(data)], dataset_scan=False, packing=False), processor)  # unscanned: when loaded
    assert len(dataset[0]["input_ids"]) == 128  # text only: its tail cut, as for text models
    with pytest.raises(DataError, match=r"long\.jsonl, line 2: 1\d\d tokens with its images, .*would cut into an image's 4"):
        dataset[1]
    fits = tmp_path / "fits.jsonl"  # the same record with a shorter question: nothing refused, at start-up or loaded
    fits.write_text(json.dumps({"messages": [{"role": "user", "content": "x" * 40 + "<image>"},
                                             {"role": "assistant", "content": "red"}], "images": [str(RED)]}) + "\n")
    dataset, _ = vision_data(vl_spec(dataset=[str(fits)], packing=False), processor)
    assert dataset.refuse_cuts() == 1 and len(dataset[0]["input_ids"]) <= 128


def test_a_preference_pair_whose_cut_falls_into_its_prompts_image_is_refused_before_the_first_step(tmp_path, processor):
    from swiftslurm.train.data.records import DataError
    from swiftslurm.train.data.vision import preference_collator

    def pair(prompt: str) -> str:
        return json.dumps({"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": "red"}],
                           "rejected": [{"role": "assistant", "content": "blue"}], "images": [str(RED)]}) + "\n"

    data = tmp_path / "pairs.jsonl"
    data.write_text(pair("<image>" + "x" * 140) + pair("x" * 140 + "<image>"))  # the image first fits; after 140 bytes not
    with pytest.raises(DataError, match=r"pairs\.jsonl, line 2: 1\d\d tokens with its images, .*would cut into an image's 4"):
        preference_collator(processor, vl_spec(task="dpo", dataset=[str(data)]).train)
    collate = preference_collator(processor, vl_spec(task="dpo", dataset=[str(data)], dataset_scan=False).train)
    first = {"prompt": [{"role": "user", "content": "<image>" + "x" * 140}], "chosen": [{"role": "assistant", "content": "red"}],
             "rejected": [{"role": "assistant", "content": "blue"}], "images": [str(RED)]}
    batch = collate([first])  # TRL keeps the start: the image's 4 tokens survive the cut at 128
    image = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert batch["input_ids"].shape[1] == 128 and int((batch["input_ids"] == image).sum()) == 2 * 4


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-vl"])
def test_a_models_processing_class_is_read_from_its_dir_once(tmp_path, monkeypatch, name):
    """A vision-language dir gives its processor; a text model's gives its tokenizer, which AutoProcessor has already
    read (a 150k-token vocabulary is not parsed twice at every rank's start)."""
    import transformers

    from swiftslurm.train.tinymodel import build_processing
    from swiftslurm.train.vision import is_multimodal, load_processing, tokenizer_of

    saved = build_processing(name)
    saved.save_pretrained(tmp_path)
    reads: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: reads.append(str(a[0])) or real(cls, *a, **k)))
    loaded = load_processing(str(tmp_path), local_only=True)
    assert is_multimodal(loaded) == (name == "tiny-vl") and type(loaded) is type(saved)
    assert tokenizer_of(loaded).get_vocab() == tokenizer_of(saved).get_vocab()
    assert tokenizer_of(loaded).chat_template == tokenizer_of(saved).chat_template
    assert len(reads) == 1, reads  # AutoProcessor's own: the tokenizer (or the processor's) is read once


def test_packing_stays_on_for_the_models_it_is_checked_on_and_is_turned_off_with_its_reason_elsewhere(processor):
    from swiftslurm.train.vision import VisionUnsupported, fit_spec

    spec, why = fit_spec(vl_spec(), processor)
    assert spec.train.packing is True and why is None  # LLaVA: 1-D positions

    # Qwen2-VL's processor needs torchvision, which this machine's torch cannot load: stand-ins of processor classes
    def like(name: str):
        return type(name, (), {"image_processor": object(), "tokenizer": processor.tokenizer,
                               "_get_num_multimodal_tokens": lambda self, **k: None})()

    assert fit_spec(vl_spec(), like("Qwen2_5_VLProcessor"))[0].train.packing is True  # per-sample 3-D positions
    spec, why = fit_spec(vl_spec(), like("Gemma3Processor"))
    assert spec.train.packing is False and "packing off for this vision-language model (Gemma3Processor)" in (why or "")
    assert fit_spec(vl_spec(packing=False), like("Gemma3Processor")) == (vl_spec(packing=False), None)
    # tiny-vl with KTO is refused at validate already (spec/vision_rules.py); a hub VL model is known by its processor
    # on the node: the same spec unvalidated, as the node sees a model whose type validate could not read
    sft = vl_spec()
    kto = sft.model_copy(update={"train": sft.train.model_copy(update={"task": "kto"})})
    with pytest.raises(VisionUnsupported, match="train.task = 'kto' does not train vision-language models"):
        fit_spec(kto, processor)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_lora_adapts_the_language_models_projections_only(processor, targets):
    from swiftslurm.train.build import _apply_lora
    from swiftslurm.train.tinymodel import build_model

    model = _apply_lora(build_model(len(processor.tokenizer), 128, 42, name="tiny-vl"), vl_spec(lora_target_modules=targets).train)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    expected = 14 if targets == "all-linear" else 4  # 2 layers x (q, k, v, o, gate, up, down) or x (q, v)
    assert len(adapted) == expected and all(".language_model." in n for n in adapted), sorted(adapted)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("vl-runs")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "one_process_runs.py"), str(out), LORA, FULL],
                          capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    rows = {json.loads(ln[len("PRESET "):])["preset"]: json.loads(ln[len("PRESET "):]) for ln in proc.stdout.splitlines()
            if ln.startswith("PRESET ")}
    assert proc.returncode == 0 and all(r["ok"] for r in rows.values()) and len(rows) == 2, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "; packing on: " in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]  # LLaVA packs
    return out, rows


@pytest.mark.slow
def test_lora_trains_the_tiny_vlm_and_its_loss_falls(runs):
    from safetensors.torch import load_file

    out, rows = runs
    loss = rows[LORA]["loss"]
    assert len(loss) == 6 and all(x == x and x < 20 for x in loss) and loss[-1] < loss[0] - 0.2, loss
    adapter = load_file(str(out / LORA / "checkpoint-6" / "adapter_model.safetensors"))
    assert len(adapter) == 28 and all(".language_model." in k for k in adapter), sorted(adapter)[:4]


@pytest.mark.slow
def test_full_fine_tuning_keeps_the_frozen_vision_tower_and_trains_the_projector(runs, processor):
    from transformers import AutoModelForImageTextToText

    from swiftslurm.train.tinymodel import build_model

    out, rows = runs
    assert rows[FULL]["loss"][-1] < rows[FULL]["loss"][0] - 0.3, rows[FULL]["loss"]
    trained = AutoModelForImageTextToText.from_pretrained(str(out / FULL / "checkpoint-4")).state_dict()
    fresh = build_model(len(processor.tokenizer), 128, 42, name="tiny-vl").state_dict()
    changed = {k for k, v in fresh.items() if not v.equal(trained[k])}
    assert not {k for k in changed if ".vision_tower." in k}
    assert {k for k in changed if ".multi_modal_projector." in k} and {k for k in changed if ".language_model." in k}


@pytest.mark.slow
def test_the_lora_export_loads_with_its_processor_equals_base_plus_adapter_and_generates_from_an_image(runs, processor, tmp_path):
    import torch
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from swiftslurm.train.tinymodel import build_model

    out, _ = runs
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "export", str(out / LORA), "--to", str(tmp_path / "m"), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout)["model_class"] == "AutoModelForImageTextToText"
    model, loaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "m")).eval(), AutoProcessor.from_pretrained(str(tmp_path / "m"))
    prompt = loaded.apply_chat_template([{"role": "user", "content": "<image>What colour is this square?"}], tokenize=False,
                                        add_generation_prompt=True)
    batch = loaded(text=[prompt], images=[Image.open(RED)], return_tensors="pt")
    reference = PeftModel.from_pretrained(build_model(len(processor.tokenizer), 128, 42, name="tiny-vl"),
                                          str(out / LORA / "checkpoint-6")).eval()
    with torch.no_grad():
        assert (model(**batch).logits - reference(**batch).logits).abs().max().item() < 1e-4
    generated = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == batch["input_ids"].shape[1] + 4


@pytest.mark.slurm
@pytest.mark.slow
def test_the_tiny_vlm_on_two_nodes_stopped_at_walltime_resumes_to_the_uninterrupted_losses(tmp_path, slurm_cluster):
    """test_resume's spec (2 nodes x 1 rank, ZeRO-2, full fine-tuning, the vision tower frozen, packed rows as by
    default) with the tiny VLM on the demo's images, beside an uninterrupted run; the walltime signal at step 8 or
    later. The checkpoint records the spec as written (packing on), which the resume compares against."""
    from test_resume import requeued_beside_reference

    req_out = requeued_beside_reference(tmp_path, "vl", 24, 8, data=DATA, train={"model": "tiny-vl", "image_max_pixels": 3136})
    logs = [p.read_text(errors="replace") for p in (req_out / "logs").rglob("*") if p.is_file() and p.suffix in (".err", ".log")]
    assert any("; packing on: " in text for text in logs)


def test_an_eval_split_keeps_each_records_images_where_its_data_file_put_them(tmp_path):
    from swiftslurm.train.data.vision import read_conversations
    from swiftslurm.train.evaluation import split_files

    train, held = split_files([str(DATA)], 0.25, tmp_path)  # written under the output dir, far from the images
    records = read_conversations([str(train), str(held)])
    assert len(records) == 19 and sum(len(r.images) for r in records) == 24
    assert all(path.is_file() for r in records for path in r.images)
