# Sourced on the GPU machine, in the checkout root: installs the carried wheels ($1) and this
# checkout into /tmp/site (that machine reaches no package index).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/*.whl || return 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
  --target /tmp/site . || return 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-', 'transformers', transformers.__version__)"
