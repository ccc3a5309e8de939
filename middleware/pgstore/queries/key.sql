{{define "key" -}}
{{if .Compact}}message_id = @message_id::text::uuid AND consumer_id = (SELECT consumer_id FROM {{.Consumers}} WHERE consumer_name = @consumer_name)
{{- else}}message_id = @message_id AND consumer_name = @consumer_name
{{- end}}{{if .Partitioned}} AND period = @period{{end}}
{{- end}}
