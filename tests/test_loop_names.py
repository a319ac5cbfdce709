"""The generated code of recursive models reads like careful hand-written C++
(#39): each recursion (forward and gradient) is a C++ scope of its own, so its
names are scoped instead of numbered (`start`, `c_l`, `schedule` in both loops,
never `start_1`, `c_l_1`); a buffer's rows at the current level are one named
pointer, not the same offset expression printed at every use; a sequence's loop
speaks of time steps, a tree's of levels; errors name the user's inputs."""

from __future__ import annotations

import re

import pytest

from conftest import load_example

MODELS = ["treelstm_sentiment", "lstm_classifier"]


@pytest.fixture(scope="module", params=MODELS)
def generated(request):
    from generator.pipeline import project_files

    graph = load_example(request.param).build()
    users = {v.name for v in list(graph.inputs) + list(graph.params)} | {str(d) for d in graph.dims}
    users |= {v.name for n in graph.nodes for v in n.outputs if v.explicit}
    source = project_files(graph)["src/model.cpp"]
    return request.param, (source if isinstance(source, str) else source.decode()), users


def _identifiers(source: str) -> set:
    """The identifiers model.cpp declares and uses, but kernels::' names (the kernels' naming
    is codegen/kernels.py's), strings and comments."""
    code = re.sub(r'"(\\.|[^"\\])*"', '""', source)
    code = re.sub(r"//[^\n]*", "", code)
    code = re.sub(r"kernels::\w+", "", code)
    return set(re.findall(r"\b[A-Za-z_]\w*\b", code))


def test_no_name_is_numbered_unless_the_user_numbered_it(generated):
    name, source, users = generated
    numbered = sorted(w for w in _identifiers(source) if re.search(r"_\d+$", w)
                      and not any(w == u or w.endswith("_" + u) or w == f"d_{u}" for u in users))
    assert numbered == [], f"{name}: numbered names {numbered}"


def test_each_levels_offset_is_written_once(generated):
    """`(start - leaves) * 64` names a pointer once per buffer and level, and the row count
    of a level is a variable of the loop."""
    name, source, _ = generated
    offsets = re.findall(r"[\w.()]+ \+ \(start - \w+\) \* \w+", source)
    assert offsets, f"{name}: no level pointers"
    repeated = sorted({o for o in offsets if offsets.count(o) > 1})
    assert repeated == [], f"{name}: offsets printed more than once: {repeated}"
    assert source.count("level_start[level + 1] - start") + source.count("step_start(step + 1) - start") == 2


def test_sequences_speak_of_time_steps_and_trees_of_levels(generated):
    name, source, _ = generated
    if name == "lstm_classifier":
        assert "for (std::int64_t step = 1; step < schedule.steps(); ++step) {" in source
        assert re.findall(r"\w*(?:leaves|level|child)\w*", source) == []
        assert "dg::gather_previous_step(" in source and "schedule.previous_rows(start)" in source
        assert "'leaf_words'" not in source and "'node_words'" not in source
    else:
        assert "for (std::int64_t level = 1; level < schedule.levels(); ++level) {" in source
        assert "gather 'emb' by 'trees_words'" in source  # the user's input, not the cell's placeholder
