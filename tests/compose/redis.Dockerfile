# A stand-in for redis:7 where Docker Hub is out of reach: Debian bookworm's redis-server (7.0), same
# command line and /data volume as the official image.
ARG DEBIAN_IMAGE=local/debian:bookworm
FROM ${DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data
WORKDIR /data
EXPOSE 6379
CMD ["redis-server"]
