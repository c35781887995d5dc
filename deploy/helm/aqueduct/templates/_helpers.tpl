{{/* The chart name, overridable. */}}
{{- define "aqueduct.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name: the StatefulSet, the client Service and the pod names' prefix.
Truncated so that "<fullname>-headless" stays within 63 characters.
*/}}
{{- define "aqueduct.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The headless Service that gives each pod its DNS name and feeds DNS discovery. */}}
{{- define "aqueduct.headlessName" -}}
{{- printf "%s-headless" (include "aqueduct.fullname" .) }}
{{- end }}

{{/* The headless Service's FQDN: cluster.discovery.host. */}}
{{- define "aqueduct.discoveryHost" -}}
{{- printf "%s.%s.svc.%s" (include "aqueduct.headlessName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{- define "aqueduct.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "aqueduct.selectorLabels" -}}
app.kubernetes.io/name: {{ include "aqueduct.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "aqueduct.labels" -}}
helm.sh/chart: {{ include "aqueduct.chart" . }}
{{ include "aqueduct.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: broker
app.kubernetes.io/part-of: aqueduct
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "aqueduct.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The chart's default broker configuration: a cluster node with DNS discovery on the headless
Service and mutual TLS between nodes, certificates from the Secret mounted at
/etc/aqueduct/certs. .Values.config is merged over it (aqueduct.config).
*/}}
{{- define "aqueduct.defaultConfig" -}}
listen_addr: ":4242"
metrics_addr: "0.0.0.0:9090"
tls:
  cert_file: /etc/aqueduct/certs/node.pem
  key_file: /etc/aqueduct/certs/node-key.pem
admin:
  enabled: false
  listen_addr: "0.0.0.0:9091"
cluster:
  enabled: true
  peers: []
  tls:
    ca_file: /etc/aqueduct/certs/ca.pem
    cert_file: /etc/aqueduct/certs/node.pem
    key_file: /etc/aqueduct/certs/node-key.pem
  compression: zstd
  discovery:
    enabled: true
    type: dns
    host: {{ include "aqueduct.discoveryHost" . }}
    port: 4242
    interval: 10s
{{- end }}

{{/*
Recursive merge: (list dst src) sets every key of src in dst; maps on both sides merge key by
key, any other value replaces, and a null removes the key. Written out (rather than sprig's
mergeOverwrite) so that false, 0 and "" override on every Helm version.
*/}}
{{- define "aqueduct.merge" -}}
{{- $dst := index . 0 }}
{{- range $key, $value := index . 1 }}
{{- if kindIs "invalid" $value }}
{{- $_ := unset $dst $key }}
{{- else if and (kindIs "map" $value) (kindIs "map" (index $dst $key)) }}
{{- include "aqueduct.merge" (list (index $dst $key) $value) }}
{{- else }}
{{- $_ := set $dst $key (deepCopy $value) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The broker's config.yaml: the default configuration with .Values.config merged over it. */}}
{{- define "aqueduct.config" -}}
{{- $config := include "aqueduct.defaultConfig" . | fromYaml }}
{{- include "aqueduct.merge" (list $config (.Values.config | default dict)) }}
{{- toYaml $config }}
{{- end }}
