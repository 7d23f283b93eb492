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
