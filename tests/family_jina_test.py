"""Jina embeddings v3 against transformers' JinaEmbeddingsV3Model, and its task adapters against the Hub's LoRA
computed unmerged (tests/jina_reference.py): XLM-R with rotary positions, one LoRA slice per task merged into
the weights at load, the task chosen by model.task."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from family_fixtures import (
    LENGTHS,
    MIN_COSINE,
    MOVED,
    assert_matches_transformers,
    assert_openvino_matches_xla,
    backends_for,
    lowest_cosine,
    our_vectors,
    reference_vectors,
    run_docbeam,
    save_checkpoint,
    token_inputs,
)
from jina_reference import (
    INSTRUCTIONS,
    RANK,
    TASKS,
    adapters_on,
    hub_config,
    hub_tensors,
    random_adapters,
    tiny_jina,
    write_hub_st_files,
)

from docbeam.models import checkpoint
from docbeam.models.families import jina


@pytest.fixture(scope="module")
def model():
    return tiny_jina()


@pytest.fixture(scope="module")
def adapters(model):
    return random_adapters(model)


@pytest.fixture(scope="module")
def transformers_folder(model, tmp_path_factory):
    return save_checkpoint(model, str(tmp_path_factory.mktemp("jina-transformers5")))


@pytest.fixture(scope="module")
def hub_folder(model, adapters, tmp_path_factory):
    folder = save_checkpoint(
        model,
        str(tmp_path_factory.mktemp("jina-hub")),
        config_rewrite=hub_config,
        tensor_rename=lambda tensors: hub_tensors(tensors, adapters),
    )
    return write_hub_st_files(folder)


def test_both_forms_read_as_rotary_xlmr_with_the_checkpoints_tasks(transformers_folder, hub_folder):
    plain, hub = (checkpoint.open_checkpoint(f).config for f in (transformers_folder, hub_folder))
    for config in (plain, hub):
        assert type(config) is jina.Config
        assert (config.position, config.rope_theta, config.rope_style, config.max_position) == (
            "rope",
            20000.0,
            "half",
            8194,
        )
    assert (plain.tasks, plain.task) == ((), None)
    assert (hub.tasks, hub.task, hub.lora_scale) == (TASKS, None, 0.5)  # no task named: the base weights


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("form", ["transformers5", "hub"])
def test_base_weights_match_transformers(model, transformers_folder, hub_folder, form, packed):
    folder = transformers_folder if form == "transformers5" else hub_folder
    assert assert_matches_transformers(model, folder, LENGTHS, packed) == ["native", "chunked", "flash"]


@pytest.mark.parametrize("packed", [False, True])
def test_every_task_merged_matches_its_adapter_computed_unmerged(model, adapters, hub_folder, packed):
    ids, lengths = token_inputs(LENGTHS)
    backends = backends_for(checkpoint.open_checkpoint(hub_folder).config.attention_features, packed)
    base = reference_vectors(model, ids, lengths)
    for index, task in enumerate(TASKS):
        with adapters_on(model, adapters, index):
            reference = reference_vectors(model, ids, lengths)
        assert lowest_cosine(reference, base) < MOVED, task  # each adapter moves the output
        for backend in backends:
            got = our_vectors(hub_folder, ids, lengths, task=task, backend=backend, packed=packed)
            assert lowest_cosine(got, reference) >= MIN_COSINE, (task, backend)


def test_a_broken_merge_or_rope_moves_the_output(model, adapters, hub_folder, tmp_path):
    import dataclasses

    ids, lengths = token_inputs(LENGTHS)
    with adapters_on(model, adapters, TASKS.index("retrieval.passage")):
        reference = reference_vectors(model, ids, lengths)
    assert lowest_cosine(our_vectors(hub_folder, ids, lengths, task="retrieval.passage"), reference) >= MIN_COSINE
    unscaled = save_checkpoint(
        model,
        str(tmp_path),
        config_rewrite=lambda c: {**hub_config(c), "lora_alpha": RANK},
        tensor_rename=lambda tensors: hub_tensors(tensors, adapters),
    )  # scale 1, not 0.5
    broken = {
        "scale": our_vectors(unscaled, ids, lengths, task="retrieval.passage"),
        "slice": our_vectors(hub_folder, ids, lengths, task="retrieval.query"),  # the neighbouring slice
        "rope": our_vectors(
            hub_folder,
            ids,
            lengths,
            task="retrieval.passage",  # every angle 0: no rotation
            change=lambda c: dataclasses.replace(c, rope_scale=0.0),
        ),
    }
    assert {name: lowest_cosine(got, reference) < MOVED for name, got in broken.items()} == dict.fromkeys(broken, True)


def test_an_unknown_task_is_refused_naming_the_key_the_value_and_the_tasks(hub_folder, transformers_folder):
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"model.task: 'retrieval.document' is not a task of .*"
        r"config.json: its lora_adaptations are retrieval.query, retrieval.passage, separation",
    ):
        checkpoint.open_checkpoint(hub_folder, task="retrieval.document")
    with pytest.raises(checkpoint.CheckpointError, match="sets no lora_adaptations"):
        checkpoint.open_checkpoint(transformers_folder, task="retrieval.passage")


def test_a_task_on_a_family_without_adapters_is_refused(tiny_checkpoint_dir):
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"model.task: 'retrieval.passage' is set, but .* has no "
        "task adapters",
    ):
        checkpoint.open_checkpoint(tiny_checkpoint_dir, task="retrieval.passage")


def test_the_checkpoints_default_task_applies_when_none_is_named(model, tmp_path):
    folder = save_checkpoint(
        model, str(tmp_path), config_rewrite=lambda c: {**hub_config(c), "default_lora_task": "separation"}
    )
    # config.json alone (this checkpoint's weights carry no adapters, which open_checkpoint refuses)
    assert checkpoint.encoder_config(str(folder)).task == "separation"
    assert checkpoint.encoder_config(str(folder), task="classification").task == "classification"
    save_checkpoint(model, str(tmp_path), config_rewrite=lambda c: {**hub_config(c), "default_lora_task": "query"})
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"default_lora_task: 'query', which is not among its "
        r"lora_adaptations \['retrieval.query'",
    ):
        checkpoint.open_checkpoint(str(folder))


def test_adapters_of_another_rank_are_refused_at_start(model, adapters, tmp_path):
    folder = save_checkpoint(
        model,
        str(tmp_path),
        config_rewrite=lambda c: {**hub_config(c), "lora_rank": 8},
        tensor_rename=lambda tensors: hub_tensors(tensors, adapters),
    )
    with pytest.raises(checkpoint.CheckpointError, match=r"word_embeddings.*lora_A \[5, 30522, 4\] .* lora_rank \(8\)"):
        checkpoint.open_checkpoint(folder, task="retrieval.passage")  # the header's shapes: nothing loaded


def test_the_hubs_task_routing_module_runs_as_sentence_transformers_transformer_with_adapters_only(
    hub_folder, transformers_folder, tmp_path
):
    settings = checkpoint.open_checkpoint(hub_folder).settings
    assert (settings.pooling, settings.normalize) == ("mean", True)
    without_adapters = write_hub_st_files(str(tmp_path))
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(transformers_folder, name), without_adapters)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"modules.json lists module 'transformer' of type "
        r"'custom_st.Transformer'",
    ):
        checkpoint.open_checkpoint(without_adapters)


def test_the_tasks_instruction_is_its_document_prompt(hub_folder):
    from docbeam.models.checkpoint.sentence_transformers.settings import document_prompt

    ck = checkpoint.open_checkpoint(hub_folder, task="retrieval.passage")
    assert document_prompt(ck.settings, "auto", hub_folder) == INSTRUCTIONS["retrieval.passage"]
    assert (
        document_prompt(checkpoint.open_checkpoint(hub_folder, task="separation").settings, "auto", hub_folder) is None
    )  # an empty instruction is no prompt
    assert document_prompt(checkpoint.open_checkpoint(hub_folder).settings, "auto", hub_folder) is None


@pytest.mark.slow
def test_docbeam_run_gives_the_tasks_vectors_with_its_instruction(model, adapters, hub_folder, tmp_path):
    """One window per document, its instruction first (the Hub's encode(task=...) puts it there)."""
    texts = {"a": "Rotary positions and task adapters.", "b": " ".join(["Passages for retrieval."] * 10)}
    got = run_docbeam(hub_folder, tmp_path, texts, model={"task": "retrieval.passage"})
    tokenizer = checkpoint.load_tokenizer(hub_folder)
    with adapters_on(model, adapters, TASKS.index("retrieval.passage")):
        for doc_id, text in texts.items():
            ids = np.asarray([tokenizer(INSTRUCTIONS["retrieval.passage"] + text)["input_ids"]], np.int32)
            want = reference_vectors(model, ids, np.asarray([ids.shape[1]], np.int32))
            assert lowest_cosine(got[doc_id][None], want) >= MIN_COSINE, doc_id


def test_the_task_is_part_of_the_reuse_key(hub_folder, tmp_path):
    """Vectors embedded with another task's adapter are other vectors: a later run does not reuse them."""
    from conftest import SAMPLE, job_config
    from incremental_test import committed_run

    from docbeam.pipeline.driver.plan import make_plan
    from docbeam.pipeline.stages.reuse import key_differences

    def plan(task, **input_section):
        cfg = job_config(SAMPLE, str(tmp_path / "out"), hub_folder, model={"task": task}, input=input_section)
        return make_plan(cfg, probe_backends=False)

    separation = plan("separation").reuse_key  # both instructions are empty: the prompts agree
    assert key_differences(separation, plan("classification").reuse_key) == [
        "task: 'separation' then, 'classification' now"
    ]
    previous = str(tmp_path / "previous")
    committed_run(previous, separation, b"PAR1" + bytes(64) + b"PAR1")
    assert plan("separation", reuse_from=previous).reuse.source is not None
    other = plan("classification", reuse_from=previous).reuse
    assert other.source is None and "task: 'separation' then, 'classification' now" in other.reason


def test_an_empty_model_task_is_a_config_error():
    from docbeam import config

    with pytest.raises(config.ConfigError, match=r"model\.task: must name one of the checkpoint's task adapters"):
        config.parse({"input": {"path": "d.jsonl"}, "output": {"path": "o"}, "model": {"task": " "}}, base_dir="/")


def test_openvino_runs_the_family_at_xla_parity(hub_folder, tmp_path):
    assert_openvino_matches_xla(hub_folder, str(tmp_path), task=TASKS[0])
