"""The supporting modules (vit, dit, mdm) honour the training contract: a Trainable whose checkpoint state
is JSON, accepted back, and refused when it describes another layout."""

import json

import pytest
from tiny_models import tiny_module

from looped_lm.errors import UserError
from looped_lm.models.contract import Trainable


@pytest.mark.parametrize("kind", ["vit", "dit", "mdm"])
def test_it_is_a_trainable_with_json_state(kind):
    model = tiny_module(kind)
    assert isinstance(model, Trainable)
    state = json.loads(json.dumps(model.checkpoint_state()))
    assert state["num_blocks"] == model.num_blocks and len(state["edges"]) == model.num_blocks + 1
    model.restore_state(state)  # its own state is accepted
    with pytest.raises(UserError, match="cannot resume"):
        model.restore_state({**state, "num_blocks": 99})
