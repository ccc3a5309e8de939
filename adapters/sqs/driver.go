package sqs

import (
	"context"
	"fmt"
	"net/url"
	"slices"

	"github.com/ThreeDotsLabs/watermill"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"

	"github.com/watermill-inbox/watermill-inbox/adapters"
	"github.com/watermill-inbox/watermill-inbox/internal/redact"
)

// Importing the package registers the "sqs" broker. Spec.URL is optional: an http(s) endpoint
// that replaces the one AWS resolves from the region (a local SQS-compatible endpoint);
// Spec.QueryProtocol switches to the AWS query protocol (goaws speaks only that one);
// Spec.Settings is a BrokerConfig (or *BrokerConfig) or nil. Region, credentials and the rest
// of the AWS configuration come from the SDK's default resolution (config.LoadDefaultConfig:
// AWS_REGION, AWS_ACCESS_KEY_ID..., AWS_PROFILE and the shared config files, then container
// and instance roles) unless the settings bring an AWSConfig with a Region; their OptFns run
// before the endpoint and protocol.
func init() {
	adapters.Register(Name, adapters.Driver{ValidateURL: validateEndpoint, Open: open})
}

// validateEndpoint accepts an empty URL (AWS's endpoint for the region) or an http(s) URL.
func validateEndpoint(u string) error {
	if u == "" {
		return nil
	}
	if p, err := url.Parse(u); err != nil || (p.Scheme != "http" && p.Scheme != "https") || p.Host == "" {
		return fmt.Errorf("%q is not an http(s) endpoint (leave it empty for AWS's endpoint for the region)", redact.URL(u))
	}
	return nil
}

func open(spec adapters.Spec, logger watermill.LoggerAdapter) (*adapters.Broker, error) {
	c, err := adapters.SettingsAs[BrokerConfig](Name, spec.Settings)
	if err != nil {
		return nil, err
	}
	if c.AWSConfig.Region == "" {
		awsCfg, err := awsconfig.LoadDefaultConfig(context.Background())
		if err != nil {
			return nil, fmt.Errorf("sqs adapter: loading the AWS configuration: %w", err)
		}
		c.AWSConfig = awsCfg
	}
	opts := slices.Clone(c.OptFns)
	if spec.URL != "" {
		opts = append(opts, Endpoint(spec.URL))
	}
	if spec.QueryProtocol {
		opts = append(opts, QueryProtocol)
	}
	c.OptFns = opts
	return New(c, redact.Logger(logger, spec.URL)) // the endpoint's password is never logged
}
