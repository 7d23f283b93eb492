{{/* Names: every object is <release>-sharetune-<part>, labelled with the part. */}}
{{- define "sharetune.name" -}}
{{- printf "%s-sharetune" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "sharetune.labels" -}}
app.kubernetes.io/name: sharetune
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "sharetune.image" -}}
{{- printf "%s%s:%s" .root.Values.image.registry .image .root.Values.image.tag -}}
{{- end -}}

{{/* A generated secret's value, kept across upgrades: the given one, else what the installed Secret already
     holds under that key (lookup; `helm template` has no cluster, so it renders a new one each time), else a
     random one. Takes (dict "root" $ "name" <secret> "key" <key> "given" <value>). */}}
{{- define "sharetune.keptSecretValue" -}}
{{- if .given -}}
{{- .given -}}
{{- else -}}
{{- $old := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if and $old $old.data (hasKey $old.data .key) -}}
{{- index $old.data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum 32 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The secret holding REDIS_URL: this chart's, or one the user names. */}}
{{- define "sharetune.redisSecret" -}}
{{- default (printf "%s-redis" (include "sharetune.name" .)) .Values.redis.existingSecret -}}
{{- end -}}

{{/* What every worker's container shares: the store's URL, the work volume, the log level. */}}
{{- define "sharetune.commonEnv" -}}
- name: REDIS_URL
  valueFrom: {secretKeyRef: {name: {{ include "sharetune.redisSecret" . }}, key: redis-url}}
- name: SHARETUNE_WORK_DIR
  value: /work
- name: SHARETUNE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
{{- end -}}

{{/* The NVIDIA runtime's driver libraries (libcuda) without a GPU: NVIDIA_VISIBLE_DEVICES=none mounts them
     and exposes no device ("void", as the image is run without the runtime, mounts nothing). */}}
{{- define "sharetune.driverWithoutGpuEnv" -}}
- name: NVIDIA_VISIBLE_DEVICES
  value: none
- name: NVIDIA_DRIVER_CAPABILITIES
  value: compute,utility
{{- end -}}

{{/* Where a pod of a part runs: its runtimeClassName (when given), nodeSelector and tolerations (the part's,
     else those of the nodes it needs: `nvidia` for the NVIDIA driver's), affinity, and how long it may finish
     its task after SIGTERM. Takes (dict "values" <part's values> "nvidia" <.Values.nvidia, or nil: any node>). */}}
{{- define "sharetune.podPlacement" -}}
{{- $nodes := .nvidia | default dict }}
{{- with $nodes.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .values.nodeSelector | default $nodes.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations | default $nodes.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.terminationGracePeriodSeconds }}
terminationGracePeriodSeconds: {{ . }}
{{- end }}
{{- end -}}

{{- define "sharetune.workVolume" -}}
- name: work
  persistentVolumeClaim: {claimName: {{ include "sharetune.name" . }}-work}
{{- end -}}

{{/* Probes of a worker: its own liveness key in Redis (services/healthcheck.py). */}}
{{- define "sharetune.workerProbes" -}}
startupProbe:
  exec: {command: ["python", "-m", "services.healthcheck"]}
  periodSeconds: 10
  timeoutSeconds: 12
  failureThreshold: 30
livenessProbe:
  exec: {command: ["python", "-m", "services.healthcheck"]}
  periodSeconds: 30
  timeoutSeconds: 12
  failureThreshold: 4
{{- end -}}
