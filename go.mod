module github.com/vksparse/vksparse

go 1.22

require github.com/x448/float16 v0.8.4

require (
	github.com/stretchr/testify v1.12.1
	go.yaml.in/yaml/v3 v3.0.5 // indirect
)
