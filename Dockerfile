# The image that `ftjax launch ... --emit k8s DIR --image IMAGE` runs: ftjax installed the way the
# README says (`pip install .`), nothing else of the checkout.
#
#   docker build -t ftjax:latest .                                      # CPU (and TPU: JAX_PLUGIN='jax[tpu]')
#   docker build --build-arg JAX_PLUGIN='jax[cuda12]' -t ftjax:cuda .   # NVIDIA GPUs
#
# The job files set the command (`ftjax coordinator ...`, `ftjax train ...`); the pods run as the
# user ftjax (uid 1000), with fsGroup 1000 so that their volumes are writable.
FROM python:3.11-slim

ARG JAX_PLUGIN=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md LICENSE MANIFEST.in ./
COPY ftjax ./ftjax
COPY ftjax_bench ./ftjax_bench
# hadolint ignore=DL3013
RUN pip install . $JAX_PLUGIN && ftjax --version && rm -rf /src

RUN useradd --create-home --uid 1000 --user-group ftjax
USER 1000:1000
WORKDIR /home/ftjax
CMD ["ftjax", "--help"]
