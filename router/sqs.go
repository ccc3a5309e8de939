package router

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strconv"

	"github.com/ThreeDotsLabs/watermill"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/adapters/sqs"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
	"github.com/watermill-inbox/watermill-inbox/middleware/inbox"
)

// envSQSQueryProtocol selects Config.SQSQueryProtocol in ConfigFromEnv.
const envSQSQueryProtocol = "INBOX_SQS_QUERY_PROTOCOL"

// sqsFromEnv reads INBOX_SQS_QUERY_PROTOCOL (1, true, 0, false...) into cfg.
func sqsFromEnv(cfg *Config) error {
	v := os.Getenv(envSQSQueryProtocol)
	if v == "" {
		return nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return fmt.Errorf("%w: router: %s=%q, want 1 or 0", inbox.ErrInvalidConfig, envSQSQueryProtocol, v)
	}
	cfg.SQSQueryProtocol = b
	return nil
}

// validateSQS accepts an empty URL (AWS's endpoint for the region) or an http(s) URL.
func validateSQS(c Config) error {
	if c.URL == "" {
		return nil
	}
	if u, err := url.Parse(c.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%w: router: broker %q: %s = %q is not an http(s) endpoint (leave it empty for AWS's endpoint for the region)", inbox.ErrInvalidConfig, c.Broker, c.setting("INBOX_BROKER_URL", "url", "URL"), redact.URL(c.URL))
	}
	return nil
}

// newSQSBroker builds the "sqs" broker: region, credentials and the rest of the AWS
// configuration come from the SDK's default resolution (config.LoadDefaultConfig: AWS_REGION,
// AWS_ACCESS_KEY_ID..., AWS_PROFILE and the shared config files, then container and instance
// roles) unless cfg.SQS brings an AWSConfig with a Region; cfg.URL, when set, replaces the
// endpoint, and cfg.SQSQueryProtocol the protocol; the other settings come from cfg.SQS.
func newSQSBroker(cfg Config, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	c := base(cfg.SQS)
	if c.AWSConfig.Region == "" {
		awsCfg, err := awsconfig.LoadDefaultConfig(context.Background())
		if err != nil {
			return nil, fmt.Errorf("router: sqs: loading the AWS configuration: %w", err)
		}
		c.AWSConfig = awsCfg
	}
	opts := slices.Clone(c.OptFns)
	if cfg.URL != "" {
		opts = append(opts, sqs.Endpoint(cfg.URL))
	}
	if cfg.SQSQueryProtocol {
		opts = append(opts, sqs.QueryProtocol)
	}
	c.OptFns = opts
	return sqs.New(c, redact.Logger(logger, cfg.URL)) // the endpoint's password is never logged
}
