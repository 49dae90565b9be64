# Hugging Face Docker Space (also runs anywhere: docker build -t sparsevid . && docker run -p 7860:7860 sparsevid)
# Conventions: python:3.11-slim, a user with uid 1000, the app on port 7860.
FROM python:3.11-slim

# torch comes from the CPU wheel index (the PyPI default is a multi-GB CUDA build). For a GPU
# machine: docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# g++: torch.compile's CPU backend (inductor) builds the compiled decode steps with it; without it the
# app runs eager (and says so).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN useradd -m -u 1000 user
USER user
ENV HOME=/home/user \
    PATH=/home/user/.local/bin:$PATH \
    PIP_EXTRA_INDEX_URL=$TORCH_INDEX \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    OMP_WAIT_POLICY=PASSIVE \
    TOKENIZERS_PARALLELISM=false \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False
WORKDIR $HOME/app

# Dependencies first (a cached layer), with the README's install command; then the code and assets.
COPY --chown=user requirements.txt .
RUN pip install --user -r requirements.txt
COPY --chown=user . .

EXPOSE 7860
CMD ["python", "app.py"]
