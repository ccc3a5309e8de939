{{define "key"}}message_id = @message_id AND consumer_name = @consumer_name{{end}}
