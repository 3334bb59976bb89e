"""`python tests/admit_any_head_dim.py ARGS...` runs `trainingrun ARGS...` with validation's check of the head
dimensions vLLM's CPU attention takes switched off (`api.checks.VLLM_CPU_HEAD_DIMS`): tests/integration/
test_vllm_failfast.py runs a model that vLLM's CPU attention refuses on purpose, as the launcher's command and as the
launcher's children's ($TRAININGRUN_CHILD_COMMAND), so that every loader of the spec admits it."""

import sys

from trainingrun.api import checks

checks.VLLM_CPU_HEAD_DIMS = tuple(range(1, 1025))

from trainingrun.cli import main  # noqa: E402 - after the check is widened

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
