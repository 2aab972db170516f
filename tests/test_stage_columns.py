"""Ray Data UDFs check their declared input columns and fail with a message naming the stage and the columns."""

from __future__ import annotations

import pyarrow as pa
import pytest

from raycurate.errors import UserError
from raycurate.stages.base import MissingColumnsError, require_columns
from raycurate.stages.data_stages import TokenizeUDF
from raycurate.stages.model_stages import EvaluateUDF
from raycurate.stages.p2d import IclProbeUDF, IfdUDF


def test_require_columns_passes_when_every_column_is_there():
    require_columns("tokenize", pa.table({"id": ["a"], "prompt": ["p"], "response": ["r"], "extra": [1]}),
                    ("id", "prompt", "response"))
    require_columns("tokenize", {"id": [1], "prompt": [2]}, ["id", "prompt"])  # dict batches too


def test_require_columns_names_the_stage_the_missing_columns_and_what_to_do():
    with pytest.raises(MissingColumnsError) as info:
        require_columns("p2d_ifd", pa.table({"id": ["a"], "input_ids": [[1, 2]]}), ("input_ids", "prompt_len"))
    message = str(info.value)
    assert "stage 'p2d_ifd'" in message and "['prompt_len']" in message and "['id', 'input_ids']" in message
    assert "--force" in message
    assert isinstance(info.value, UserError)  # the CLI prints it without a traceback


@pytest.mark.parametrize("udf_class", [TokenizeUDF, EvaluateUDF, IclProbeUDF, IfdUDF])
def test_udfs_check_their_declared_columns_before_any_work(udf_class):
    udf = udf_class.__new__(udf_class)  # no model / tokenizer: the check must come first
    udf.stage = "some_stage"
    assert udf_class.REQUIRED_COLUMNS
    with pytest.raises(MissingColumnsError, match="stage 'some_stage'.*" + udf_class.REQUIRED_COLUMNS[-1]):
        udf(pa.table({"unrelated": [1]}))
