package lease

import "errors"

var ErrTokenInvalid = errors.New("token invalid")

// checkToken validates the bearer token that came with a renewal request.
func checkToken(token string, want string) error {
	if token == "" {
		return errors.New("missing token")
	}
	if token != want {
		return ErrTokenInvalid
	}
	return nil
}
