"""Run in mergekit's own venv (not by pytest): what mergekit 0.1.5's planner resolves for a config.

    python mergekit_oracle.py plan CONFIG.yml  ->  JSON {tensor: {"shared": {...}, "inputs": {model path: {...}}}}
    python mergekit_oracle.py defaults         ->  JSON {method: {parameter: default or "required"}}

tests/test_configs.py compares mergedb.configs against both; nothing is merged.
"""

import json
import sys

import yaml
from mergekit.architecture import get_architecture_info
from mergekit.config import MergeConfiguration
from mergekit.io.tasks import LoaderCache
from mergekit.merge import _model_out_config
from mergekit.options import MergeOptions
from mergekit.plan import MergePlanner

if sys.argv[1] == "defaults":
    from mergekit.merge_methods import registry

    print(
        json.dumps(
            {
                m.spec.name: {p.name: ("required" if p.required else p.default) for p in m.spec.parameters}
                for m in registry.registered_methods()
            }
        )
    )
    sys.exit(0)
with open(sys.argv[2]) as f:
    config = MergeConfiguration.model_validate(yaml.safe_load(f))
options = MergeOptions()
arch = get_architecture_info(config, options)
LoaderCache().setup(options=options)
for model in config.referenced_models():
    LoaderCache().get(model)
out_cfg = _model_out_config(config, arch, trust_remote_code=False)
result = {}
planner = MergePlanner(config, arch, options, out_cfg)
planner._plan()  # what plan_to_disk and plan_in_memory run first; the tasks are not executed
for weight, task in planner._tensors:
    result[weight.name] = {
        "shared": dict(task.parameters.items()),
        "inputs": {str(m.model.path): dict(v.items()) for m, v in task.input_parameters.items()},
    }
print(json.dumps(result))
