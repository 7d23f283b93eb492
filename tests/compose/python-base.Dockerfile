# A stand-in for python:3.11-slim-bookworm where Docker Hub is out of reach: Debian bookworm (debootstrap +
# docker import, tests/compose/run.sh) with its Python 3.11 in a venv on PATH, so the service Dockerfiles'
# `python` and `pip` work unchanged. The host's certificate authorities (the build context's *.crt) are
# trusted, so apt and pip inside the builds reach what the host reaches.
ARG DEBIAN_IMAGE=local/debian:bookworm
FROM ${DEBIAN_IMAGE}
COPY ca-certificates/ /usr/local/share/ca-certificates/
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && update-ca-certificates && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
# pip uses its own CA bundle unless told: the system one has the host's authorities
ENV PATH=/opt/venv/bin:$PATH PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1
CMD ["python3"]
