"""What every CPU pipeline rank imports, imported once in the fork server that forks the ranks.

megatron-core takes seconds to import and warns at import time that TransformerEngine and Apex
are missing; imported here (warnings silenced), each forked rank starts with it loaded.
"""

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.pipeline_parallel.schedules  # noqa: F401

    import mhc_cg.lab.pipeline.rank  # noqa: F401
